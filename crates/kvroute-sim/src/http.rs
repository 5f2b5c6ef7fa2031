//! HTTP/1.1 plumbing shared by the simulated engines: request heads
//! (parsed with `httparse`), bodies by `content-length` or chunked, kept-alive
//! connections with pipelining, and small response helpers. Responses are
//! written by hand; there is no HTTP library beyond the head parser.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::Duration;

/// Largest request head (request line plus headers) accepted.
pub(crate) const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Most headers parsed in one request head.
pub(crate) const MAX_HEADERS: usize = 64;
/// A connection idle for this long between requests is closed.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// Longest line in a chunked body (size line or trailer).
pub(crate) const MAX_LINE_BYTES: usize = 8 * 1024;

/// One request head, as far as the simulated engines care.
pub(crate) struct Head {
    pub(crate) method: String,
    pub(crate) path: String,
    pub(crate) content_length: Option<u64>,
    pub(crate) chunked: bool,
    pub(crate) keep_alive: bool,
}

impl Head {
    /// The path without its query string.
    pub(crate) fn route_path(&self) -> &str {
        self.path.split('?').next().unwrap_or_default()
    }
}

/// Why a request body could not be read.
#[derive(Debug)]
pub(crate) enum BodyError {
    /// Larger than the cap: answer 413 and close the connection.
    TooLarge,
    /// The connection failed or the framing was bad.
    Io(io::Error),
}

impl From<io::Error> for BodyError {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

/// A connection with its own read buffer (requests may be pipelined).
pub(crate) struct Conn {
    pub(crate) stream: TcpStream,
    buf: Vec<u8>,
    pos: usize,
    end: usize,
}

impl Conn {
    pub(crate) fn new(stream: TcpStream) -> Self {
        Self {
            stream,
            buf: vec![0; 16 * 1024],
            pos: 0,
            end: 0,
        }
    }

    fn buffered(&self) -> &[u8] {
        self.buf.get(self.pos..self.end).unwrap_or_default()
    }

    /// Reads more bytes after the buffered ones; Ok(0) at end of stream.
    fn fill(&mut self) -> io::Result<usize> {
        if self.pos > 0 {
            self.buf.copy_within(self.pos..self.end, 0);
            self.end -= self.pos;
            self.pos = 0;
        }
        if self.end == self.buf.len() {
            let grown = (self.buf.len() * 2).min(MAX_HEAD_BYTES + MAX_LINE_BYTES);
            if grown <= self.buf.len() {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "line too long"));
            }
            self.buf.resize(grown, 0);
        }
        let spare = self.buf.get_mut(self.end..).unwrap_or_default();
        let n = self.stream.read(spare)?;
        self.end += n;
        Ok(n)
    }

    /// The next request head; None when the client closed cleanly between
    /// requests.
    pub(crate) fn head(&mut self) -> io::Result<Option<Head>> {
        loop {
            if self.pos < self.end {
                let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
                let mut req = httparse::Request::new(&mut headers);
                match req.parse(self.buffered()) {
                    Ok(httparse::Status::Complete(used)) => {
                        let head = to_head(&req)?;
                        self.pos += used;
                        return Ok(Some(head));
                    }
                    Ok(httparse::Status::Partial) => {
                        if self.end - self.pos > MAX_HEAD_BYTES {
                            return Err(io::Error::new(
                                io::ErrorKind::InvalidData,
                                "request head too large",
                            ));
                        }
                    }
                    Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e)),
                }
            }
            if self.fill()? == 0 {
                return if self.pos == self.end {
                    Ok(None)
                } else {
                    Err(io::ErrorKind::UnexpectedEof.into())
                };
            }
        }
    }

    /// Reads and drops `n` body bytes.
    pub(crate) fn skip(&mut self, mut n: u64) -> io::Result<()> {
        while n > 0 {
            if self.pos == self.end {
                self.pos = 0;
                self.end = 0;
                let cap = self.buf.len();
                let want = usize::try_from(n).unwrap_or(cap).min(cap);
                let dst = self.buf.get_mut(..want).unwrap_or_default();
                let got = self.stream.read(dst)?;
                if got == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                self.end = got;
            }
            let avail = (self.end - self.pos) as u64;
            let take = avail.min(n);
            // take <= avail, which fits in usize.
            self.pos += usize::try_from(take).unwrap_or(0);
            n -= take;
        }
        Ok(())
    }

    /// One CRLF- (or LF-) terminated line, without its terminator.
    fn line(&mut self) -> io::Result<Vec<u8>> {
        loop {
            if let Some(i) = self.buffered().iter().position(|&b| b == b'\n') {
                let raw = self.buffered().get(..i).unwrap_or_default();
                let line = raw.strip_suffix(b"\r").unwrap_or(raw).to_vec();
                self.pos += i + 1;
                return Ok(line);
            }
            if self.end - self.pos > MAX_LINE_BYTES {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "line too long"));
            }
            if self.fill()? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
    }

    /// Reads and drops a chunked body (trailers included); returns its size.
    pub(crate) fn skip_chunked(&mut self) -> io::Result<u64> {
        let mut total = 0u64;
        loop {
            let line = self.line()?;
            let size_part = line.split(|&b| b == b';').next().unwrap_or_default();
            let text = std::str::from_utf8(size_part)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            let size = u64::from_str_radix(text.trim(), 16)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            if size == 0 {
                // Trailers, up to the empty line.
                while !self.line()?.is_empty() {}
                return Ok(total);
            }
            self.skip(size)?;
            total = total.saturating_add(size);
            if !self.line()?.is_empty() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "chunk not followed by CRLF",
                ));
            }
        }
    }
    /// Reads `n` body bytes onto the end of `out`.
    fn take(&mut self, mut n: usize, out: &mut Vec<u8>) -> io::Result<()> {
        while n > 0 {
            if self.pos == self.end && self.fill()? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            let have = self.buffered();
            let take = have.len().min(n);
            out.extend_from_slice(have.get(..take).unwrap_or_default());
            self.pos += take;
            n -= take;
        }
        Ok(())
    }

    /// The whole request body (by `content-length` or chunked), at most
    /// `cap` bytes. A content-length over the cap is refused before any of
    /// the body is read.
    pub(crate) fn read_body(&mut self, head: &Head, cap: usize) -> Result<Vec<u8>, BodyError> {
        let mut body = Vec::new();
        if head.chunked {
            loop {
                let line = self.line()?;
                let size_part = line.split(|&b| b == b';').next().unwrap_or_default();
                let text = std::str::from_utf8(size_part)
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                let size = usize::from_str_radix(text.trim(), 16)
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                if size == 0 {
                    while !self.line()?.is_empty() {}
                    return Ok(body);
                }
                if body.len().saturating_add(size) > cap {
                    return Err(BodyError::TooLarge);
                }
                self.take(size, &mut body)?;
                if !self.line()?.is_empty() {
                    return Err(BodyError::Io(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "chunk not followed by CRLF",
                    )));
                }
            }
        }
        let n = head.content_length.unwrap_or(0);
        let n = usize::try_from(n).map_err(|_| BodyError::TooLarge)?;
        if n > cap {
            return Err(BodyError::TooLarge);
        }
        body.reserve(n);
        self.take(n, &mut body)?;
        Ok(body)
    }
}

pub(crate) fn to_head(req: &httparse::Request<'_, '_>) -> io::Result<Head> {
    let bad = |m: &str| io::Error::new(io::ErrorKind::InvalidData, m.to_owned());
    let mut head = Head {
        method: req.method.unwrap_or_default().to_owned(),
        path: req.path.unwrap_or_default().to_owned(),
        content_length: None,
        chunked: false,
        // HTTP/1.1 defaults to keep-alive, 1.0 to close.
        keep_alive: req.version == Some(1),
    };
    for h in req.headers.iter() {
        let value = std::str::from_utf8(h.value).map_err(|_| bad("header not UTF-8"))?;
        if h.name.eq_ignore_ascii_case("content-length") {
            let n = value
                .trim()
                .parse::<u64>()
                .map_err(|_| bad("bad content-length"))?;
            head.content_length = Some(n);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            head.chunked = value
                .rsplit(',')
                .next()
                .is_some_and(|v| v.trim().eq_ignore_ascii_case("chunked"));
        } else if h.name.eq_ignore_ascii_case("connection") {
            for token in value.split(',') {
                let token = token.trim();
                if token.eq_ignore_ascii_case("close") {
                    head.keep_alive = false;
                } else if token.eq_ignore_ascii_case("keep-alive") {
                    head.keep_alive = true;
                }
            }
        }
    }
    Ok(head)
}

/// `s` as a JSON string literal (also valid as a Prometheus label value
/// for the names used here).
pub(crate) fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => {
                let _ = std::fmt::Write::write_fmt(&mut out, format_args!("\\u{:04x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Writes a whole response with a `content-length` body into `out`.
pub(crate) fn write_response(
    out: &mut Vec<u8>,
    status: &str,
    ctype: &str,
    body: &[u8],
    keep_alive: bool,
    head_only: bool,
) {
    let connection = if keep_alive { "keep-alive" } else { "close" };
    let _ = write!(
        out,
        "HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: {connection}\r\n\r\n",
        body.len()
    );
    if !head_only {
        out.extend_from_slice(body);
    }
}

/// Writes one chunk of a chunked body into `out` (nothing for an empty one:
/// an empty chunk would end the body).
pub(crate) fn write_chunk(out: &mut Vec<u8>, data: &[u8]) {
    if data.is_empty() {
        return;
    }
    let _ = write!(out, "{:x}\r\n", data.len());
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

/// The last chunk of a chunked body.
pub(crate) const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// Accepts connections until `stopped()` says so (checked after each
/// accept: the owner wakes the blocking accept with a connection of its
/// own), serving each on its own thread named `name`. Accept or spawn
/// failures (EMFILE and the like) back off instead of spinning.
pub fn accept_loop<F>(
    listener: &TcpListener,
    name: &str,
    stack_size: usize,
    stopped: impl Fn() -> bool,
    serve: F,
) where
    F: Fn(TcpStream) + Clone + Send + 'static,
{
    for conn in listener.incoming() {
        if stopped() {
            break;
        }
        let Ok(stream) = conn else {
            thread::sleep(Duration::from_millis(10));
            continue;
        };
        let serve = serve.clone();
        let spawned = thread::Builder::new()
            .name(name.to_owned())
            .stack_size(stack_size)
            .spawn(move || serve(stream));
        if spawned.is_err() {
            thread::sleep(Duration::from_millis(10));
        }
    }
}
