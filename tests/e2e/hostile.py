"""Raw clients and probes for tests/e2e/test_hostile.py.

Hostile input needs more control than httpx gives: header names in any case,
repeated headers, bodies shorter than their Content-Length, bytes dribbled
one at a time, pipelined requests, HTTP/2 frames written by hand. Everything
here talks to 127.0.0.1 (or ::1) only and every socket has a timeout, so a
case can never hang the suite.

- `h1_exchange`: bytes in, the HTTP/1.1 responses out (in order);
- `h2_exchange`: HTTP/2 cleartext with prior knowledge (the `h2` package),
  several streams on one connection, each answered or reset;
- `Decoy`: a listener on a non-fleet loopback port that records every
  connection (and answers as "DECOY", so a leak is unmistakable);
- `crash_markers`: what in an Envoy log means the Wasm VM failed;
- `envoy_memory`: VmRSS / VmHWM of the Envoy process, the /memory admin
  endpoint and the wasm stats from /stats.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable

LOCALHOST = "127.0.0.1"

# An Envoy log line with any of these means the filter trapped or its VM died.
CRASH_MARKERS = (
    "panicked",
    "wasm trap",
    "Function: proxy_on_",
    "Wasm VM failed",
    "VM failed",
    "failed to create Wasm",
    "Failed to create Wasm",
)
_VM_FAILED = re.compile(r"\bVM\b.*\bfailed\b", re.IGNORECASE)


def crash_markers(log_text: str) -> list[str]:
    """Lines of an Envoy log that say the Wasm VM panicked, trapped or failed."""
    bad = []
    for line in log_text.splitlines():
        if any(m in line for m in CRASH_MARKERS) or _VM_FAILED.search(line):
            bad.append(line)
    return bad


# ------------------------------------------------------------------ HTTP/1.1


@dataclass
class H1Response:
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    @property
    def served_by(self) -> str | None:
        return self.header("x-served-by")

    @property
    def decision(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for part in (self.header("x-kvroute-decision") or "").split(";"):
            k, sep, v = part.strip().partition("=")
            if sep:
                out[k.strip()] = v.strip()
        return out

    @property
    def json(self):
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    def describe(self) -> str:
        return (
            f"HTTP {self.status} served_by={self.served_by} "
            f"decision={self.header('x-kvroute-decision')!r} body={self.body[:200]!r}"
        )


@dataclass
class H1Result:
    responses: list[H1Response]
    closed: bool  # the server closed the connection
    error: str | None  # reset, timeout
    elapsed: float


class _Reader:
    def __init__(self, sock: socket.socket, deadline: float):
        self.sock = sock
        self.buf = b""
        self.deadline = deadline
        self.eof = False

    def _fill(self) -> bool:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("deadline")
        self.sock.settimeout(min(remaining, 5.0))
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            self.eof = True
            return False
        self.buf += chunk
        return True

    def until(self, sep: bytes) -> bytes | None:
        while sep not in self.buf:
            if not self._fill():
                return None
        head, _, self.buf = self.buf.partition(sep)
        return head

    def exactly(self, n: int) -> bytes | None:
        while len(self.buf) < n:
            if not self._fill():
                return None
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def rest(self) -> bytes:
        while self._fill():
            pass
        out, self.buf = self.buf, b""
        return out


def _read_response(r: _Reader) -> H1Response | None:
    head = r.until(b"\r\n\r\n")
    if head is None:
        return None
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    status = int(parts[1])
    headers = []
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers.append((k.strip(), v.strip()))
    hd = {k.lower(): v for k, v in headers}
    if "chunked" in hd.get("transfer-encoding", "").lower():
        body = b""
        while True:
            size_line = r.until(b"\r\n")
            if size_line is None:
                break
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                r.until(b"\r\n")
                break
            body += r.exactly(size) or b""
            r.exactly(2)
    elif "content-length" in hd:
        body = r.exactly(int(hd["content-length"])) or b""
    elif status in (204, 304) or 100 <= status < 200:
        body = b""
    else:
        body = r.rest()
    return H1Response(status, parts[2] if len(parts) > 2 else "", headers, body)


def h1_exchange(
    port: int,
    payload: bytes | Iterable[bytes],
    *,
    responses: int = 1,
    timeout: float = 15.0,
    dribble_delay: float = 0.0,
    shutdown_write: bool = False,
    close_after_send: bool = False,
    host: str = LOCALHOST,
) -> H1Result:
    """Write `payload` (bytes, or pieces written one by one with
    `dribble_delay` between them) on one connection and read up to
    `responses` answers. close_after_send: close without reading (a client
    that gives up); shutdown_write: half-close after sending."""
    started = time.monotonic()
    deadline = started + timeout
    out: list[H1Response] = []
    closed = False
    error = None
    with socket.create_connection((host, port), timeout=min(timeout, 5.0)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            pieces = [payload] if isinstance(payload, (bytes, bytearray)) else payload
            for piece in pieces:
                if time.monotonic() > deadline:
                    raise TimeoutError("deadline while sending")
                s.sendall(piece)
                if dribble_delay:
                    time.sleep(dribble_delay)
            if close_after_send:
                return H1Result([], False, None, time.monotonic() - started)
            if shutdown_write:
                s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError) as exc:
            # The server may answer (and close) before we finish sending.
            error = f"send: {type(exc).__name__}"
        except TimeoutError as exc:
            error = f"send: {exc}"
        reader = _Reader(s, deadline)
        try:
            while len(out) < responses:
                resp = _read_response(reader)
                if resp is None:
                    closed = True
                    break
                out.append(resp)
        except (ConnectionResetError, BrokenPipeError) as exc:
            closed, error = True, error or f"recv: {type(exc).__name__}"
        except (TimeoutError, socket.timeout):
            error = error or "recv: timeout"
    return H1Result(out, closed, error, time.monotonic() - started)


def h1_request(
    method: str,
    path: str,
    headers: list[tuple[str, str]] | list[tuple[bytes, bytes]] = (),
    body: bytes | None = None,
    *,
    content_length: int | None = None,
    host_header: bool = True,
) -> bytes:
    """One HTTP/1.1 request as bytes. Headers are written exactly as given
    (any case, repeats kept). content_length overrides the real length
    (to lie about it); body None and no content_length: no header."""
    lines = [f"{method} {path} HTTP/1.1".encode("latin-1")]
    if host_header:
        lines.append(b"host: kvroute.test")
    for k, v in headers:
        k = k if isinstance(k, bytes) else k.encode("latin-1")
        v = v if isinstance(v, bytes) else v.encode("latin-1")
        lines.append(k + b": " + v)
    if content_length is None and body is not None:
        content_length = len(body)
    if content_length is not None:
        lines.append(b"content-length: " + str(content_length).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + (body or b"")


# -------------------------------------------------------------------- HTTP/2


@dataclass
class H2Stream:
    """One HTTP/2 request to send: headers (lower-case names unless the case
    says otherwise), an optional body and optional trailers."""

    headers: list[tuple[str, str]]
    body: bytes = b""
    trailers: list[tuple[str, str]] | None = None
    reset_after_headers: bool = False


@dataclass
class H2Answer:
    status: int | None = None
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    reset: int | None = None  # RST_STREAM error code
    ended: bool = False

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    @property
    def served_by(self) -> str | None:
        return self.header("x-served-by")

    @property
    def decision(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for part in (self.header("x-kvroute-decision") or "").split(";"):
            k, sep, v = part.strip().partition("=")
            if sep:
                out[k.strip()] = v.strip()
        return out

    @property
    def json(self):
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    def describe(self) -> str:
        return (
            f"h2 status={self.status} reset={self.reset} served_by={self.served_by} "
            f"decision={self.header('x-kvroute-decision')!r} body={self.body[:200]!r}"
        )


@dataclass
class H2Result:
    answers: list[H2Answer]
    goaway: int | None  # GOAWAY error code, if the server sent one
    closed: bool
    elapsed: float


def h2_request_headers(port: int, method: str, path: str, extra: list[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    return [
        (":method", method),
        (":scheme", "http"),
        (":authority", f"{LOCALHOST}:{port}"),
        (":path", path),
        *extra,
    ]


def h2_exchange(port: int, streams: list[H2Stream], *, timeout: float = 15.0, validate: bool = True) -> H2Result:
    """Send every stream on one h2c (prior knowledge) connection, then read
    until each is answered or reset, the connection goes away, or timeout.
    validate=False lets the h2 package send what it would normally refuse
    (upper-case names, ...) so Envoy's own checks are what is tested."""
    import h2.config  # noqa: PLC0415
    import h2.connection  # noqa: PLC0415
    import h2.events  # noqa: PLC0415
    import h2.exceptions  # noqa: PLC0415
    import h2.errors  # noqa: PLC0415

    started = time.monotonic()
    deadline = started + timeout
    cfg = h2.config.H2Configuration(
        client_side=True,
        header_encoding="utf-8",
        validate_outbound_headers=validate,
        normalize_outbound_headers=validate,
        validate_inbound_headers=False,
    )
    conn = h2.connection.H2Connection(config=cfg)
    answers: dict[int, H2Answer] = {}
    order: list[int] = []
    goaway = None
    closed = False
    with socket.create_connection((LOCALHOST, port), timeout=min(timeout, 5.0)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.initiate_connection()
        conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 24})
        conn.increment_flow_control_window(1 << 30)
        s.sendall(conn.data_to_send())
        pending_bodies: dict[int, tuple[memoryview, H2Stream]] = {}
        for st in streams:
            sid = conn.get_next_available_stream_id()
            order.append(sid)
            answers[sid] = H2Answer()
            end = not st.body and st.trailers is None and not st.reset_after_headers
            conn.send_headers(sid, st.headers, end_stream=end)
            if st.reset_after_headers:
                conn.reset_stream(sid, error_code=h2.errors.ErrorCodes.CANCEL)
                answers[sid].reset = -1  # reset by us
            elif not end:
                pending_bodies[sid] = (memoryview(st.body), st)
        s.sendall(conn.data_to_send())

        def pump_bodies() -> None:
            for sid in list(pending_bodies):
                data, st = pending_bodies[sid]
                try:
                    while data:
                        window = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
                        if window <= 0:
                            break
                        conn.send_data(sid, bytes(data[:window]))
                        data = data[window:]
                    if not data:
                        if st.trailers is not None:
                            conn.send_headers(sid, st.trailers, end_stream=True)
                        else:
                            conn.end_stream(sid)
                        del pending_bodies[sid]
                    else:
                        pending_bodies[sid] = (data, st)
                except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                    del pending_bodies[sid]

        def done() -> bool:
            return all(a.ended or a.reset is not None for a in answers.values())

        pump_bodies()
        s.sendall(conn.data_to_send())
        while not done() and time.monotonic() < deadline:
            s.settimeout(max(min(deadline - time.monotonic(), 2.0), 0.05))
            try:
                data = s.recv(1 << 16)
            except (TimeoutError, socket.timeout):
                continue
            except ConnectionResetError:
                closed = True
                break
            if not data:
                closed = True
                break
            try:
                events = conn.receive_data(data)
            except h2.exceptions.ProtocolError:
                closed = True
                break
            for ev in events:
                a = answers.get(getattr(ev, "stream_id", 0))
                if isinstance(ev, h2.events.ResponseReceived) and a is not None:
                    a.headers = [(k if isinstance(k, str) else k.decode(), v if isinstance(v, str) else v.decode())
                                 for k, v in ev.headers]
                    st = a.header(":status")
                    a.status = int(st) if st else None
                elif isinstance(ev, h2.events.DataReceived) and a is not None:
                    a.body += ev.data
                    conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                elif isinstance(ev, h2.events.StreamEnded) and a is not None:
                    a.ended = True
                elif isinstance(ev, h2.events.StreamReset) and a is not None:
                    if a.reset is None:
                        a.reset = int(ev.error_code)
                elif isinstance(ev, h2.events.ConnectionTerminated):
                    goaway = int(ev.error_code)
                elif isinstance(ev, h2.events.WindowUpdated):
                    pass
            pump_bodies()
            out = conn.data_to_send()
            if out:
                try:
                    s.sendall(out)
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
            if goaway is not None and done():
                break
            if goaway is not None:
                # Streams above the GOAWAY's last stream id will never be answered.
                break
    return H2Result([answers[sid] for sid in order], goaway, closed, time.monotonic() - started)


# --------------------------------------------------------------------- decoy


class Decoy:
    """A listener on a loopback port that is NOT in the fleet. Records every
    connection and answers any request 200 with x-served-by: DECOY, so a
    request that leaks to it is visible both here and at the client."""

    def __init__(self, host: str = LOCALHOST, family: int = socket.AF_INET):
        self.host = host
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections: list[bytes] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"decoy-{self.port}", daemon=True)

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def start(self) -> "Decoy":
        self._thread.start()
        return self

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(1.0)
                try:
                    first = conn.recv(4096)
                except OSError:
                    first = b""
                with self._lock:
                    self.connections.append(first)
                body = b'{"served_by": "DECOY"}'
                try:
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nx-served-by: DECOY\r\ncontent-type: application/json\r\n"
                        b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
                    )
                except OSError:
                    pass

    def hits(self) -> int:
        with self._lock:
            return len(self.connections)

    def stop(self) -> None:
        self._stop.set()
        self.sock.close()
        self._thread.join(timeout=2)


def ipv6_loopback_available() -> bool:
    try:
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    except OSError:
        return False
    try:
        s.bind(("::1", 0))
        return True
    except OSError:
        return False
    finally:
        s.close()


# -------------------------------------------------------------------- memory


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, VmSize of a process in KiB (from /proc/PID/status)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "VmHWM", "VmSize"):
                    out[k] = int(v.split()[0])
    except OSError:
        pass
    return out


def wasm_memory_rss(pid: int, min_guard_kib: int = 4 << 20) -> tuple[int, int] | None:
    """(count, resident KiB) of the Wasm linear memories of a process.

    V8 reserves each Wasm linear memory as one 8 GiB region (the 4 GiB a
    wasm32 address reaches plus guard pages) and makes only the pages in use
    accessible: in /proc/PID/smaps that is a read-write mapping directly
    followed by a huge inaccessible (`---p`) one. Nothing else in Envoy maps
    that much, so the resident size of the read-write parts of those regions
    is what the VMs' linear memories use."""
    maps = []
    try:
        with open(f"/proc/{pid}/smaps", encoding="ascii", errors="replace") as f:
            for line in f:
                first = line.split(" ", 1)[0]
                if "-" in first and ":" not in first:
                    lo, hi = (int(x, 16) for x in first.split("-"))
                    perms = line.split()[1]
                    maps.append({"lo": lo, "hi": hi, "perms": perms, "rss": 0})
                elif line.startswith("Rss:") and maps:
                    maps[-1]["rss"] = int(line.split()[1])
    except OSError:
        return None
    by_end = {m["hi"]: m for m in maps if m["perms"].startswith("rw")}
    count = total = 0
    for m in maps:
        if m["perms"].startswith("---") and (m["hi"] - m["lo"]) // 1024 >= min_guard_kib:
            count += 1
            rw = by_end.get(m["lo"])
            if rw is not None:
                total += rw["rss"]
    return count, total


def envoy_memory(envoy) -> dict:
    """What Envoy says about its memory, plus what the kernel says.

    - rss_kib / hwm_kib: /proc/PID/status VmRSS / VmHWM (V8's Wasm linear
      memories are mmapped outside Envoy's allocator, so only RSS sees them);
    - wasm_memories / wasm_rss_kib: how many Wasm linear memories V8 has
      mapped and how much of them is resident (`wasm_memory_rss`);
    - allocated / heap_size: the /memory admin endpoint (tcmalloc);
    - wasm_stats: every /stats line with "wasm" in its name (VM counts).
    """
    st = proc_status(envoy.proc.pid)
    wasm = wasm_memory_rss(envoy.proc.pid)
    if wasm is not None:
        st["wasm_memories"], st["wasm_rss_kib"] = wasm
    mem = {}
    try:
        mem = json.loads(envoy.admin("/memory"))
    except Exception:  # noqa: BLE001 - a report, not a check
        pass
    wasm_stats = {}
    try:
        for line in envoy.admin("/stats?filter=wasm").splitlines():
            k, _, v = line.partition(": ")
            if k and v.strip().lstrip("-").isdigit():
                wasm_stats[k.strip()] = int(v)
    except Exception:  # noqa: BLE001
        pass
    return {
        "rss_kib": st.get("VmRSS"),
        "hwm_kib": st.get("VmHWM"),
        "wasm_memories": st.get("wasm_memories"),
        "wasm_rss_kib": st.get("wasm_rss_kib"),
        "allocated": int(mem.get("allocated", 0) or 0),
        "heap_size": int(mem.get("heap_size", 0) or 0),
        "wasm_stats": wasm_stats,
    }
