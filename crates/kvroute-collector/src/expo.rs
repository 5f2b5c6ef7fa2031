//! A small reader for the Prometheus text exposition format (0.0.4, plus the
//! OpenMetrics bits engines may emit: `# EOF`, trailing exemplars).
//!
//! Why not the `prometheus-parse` crate: its sample pattern only accepts
//! `\w+` metric names, so every `vllm:*` and `sglang:*` series (names with a
//! colon, which the format allows) is silently dropped, and it splits label
//! values on `,` and `=`, which breaks `running_lora_adapters="a,b"`. This
//! reader follows the grammar instead:
//!
//! ```text
//! line   = blank | "#" anything | sample
//! sample = name [ "{" [ label { "," label } [","] ] "}" ] value [ timestamp ] [ "#" exemplar ]
//! name   = [a-zA-Z_:][a-zA-Z0-9_:]*
//! label  = [a-zA-Z_][a-zA-Z0-9_]* "=" '"' escaped-utf8 '"'      (escapes: \\ \" \n)
//! value  = a float, NaN, +Inf, -Inf
//! ```
//!
//! It borrows from the body and allocates only for the samples the caller
//! keeps (`keep` filters by metric name), so scraping a 100 KB vLLM page with
//! hundreds of histogram buckets stays cheap. A malformed line is skipped and
//! counted; the body as a whole is rejected as "not exposition text" when no
//! line is a valid sample, or when bad lines outnumber good ones (an HTML error
//! page or a JSON body), never because of one odd line.

use std::borrow::Cow;
use std::fmt;

/// One sample line: `name{labels} value`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    /// The validated text between the braces, escapes still in place.
    raw_labels: &'a str,
    /// May be NaN or infinite: callers decide what that means.
    pub value: f64,
}

impl<'a> Sample<'a> {
    /// `(name, value)` pairs, unescaped, in line order.
    pub fn labels(&self) -> Labels<'a> {
        Labels {
            rest: self.raw_labels,
        }
    }

    /// The value of label `key`, if present.
    pub fn label(&self, key: &str) -> Option<Cow<'a, str>> {
        self.labels().find(|(k, _)| *k == key).map(|(_, v)| v)
    }
}

/// Iterator over a sample's labels (see [`Sample::labels`]).
#[derive(Debug, Clone)]
pub struct Labels<'a> {
    rest: &'a str,
}

impl<'a> Iterator for Labels<'a> {
    type Item = (&'a str, Cow<'a, str>);

    fn next(&mut self) -> Option<Self::Item> {
        // The block was validated by `scan_labels`; a surprise simply ends
        // the iteration.
        let s = self
            .rest
            .trim_start_matches(|c: char| c == ',' || c.is_whitespace());
        let eq = s.find('=')?;
        let name = s.get(..eq)?.trim_end();
        let after = s.get(eq + 1..)?.trim_start();
        let body = after.strip_prefix('"')?;
        let end = closing_quote(body)?;
        let raw = body.get(..end)?;
        self.rest = body.get(end + 1..)?;
        Some((name, unescape(raw)))
    }
}

/// Why a line is not a sample. `line` is 1-based.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    pub line: usize,
    pub reason: &'static str,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}", self.reason)
        } else {
            write!(f, "line {}: {}", self.line, self.reason)
        }
    }
}

impl std::error::Error for ParseError {}

/// A parsed body: the kept samples and how many lines were skipped as bad.
#[derive(Debug, Clone, PartialEq)]
pub struct Exposition<'a> {
    pub samples: Vec<Sample<'a>>,
    /// Valid sample lines, kept or not.
    pub good_lines: usize,
    pub bad_lines: usize,
    pub first_error: Option<ParseError>,
}

/// Parses `text`, keeping the samples whose name passes `keep`.
///
/// Errors when the text is not exposition text at all: empty, no valid
/// sample line, or more bad lines than good ones.
pub fn parse<'a>(text: &'a str, keep: impl Fn(&str) -> bool) -> Result<Exposition<'a>, ParseError> {
    let mut out = Exposition {
        samples: Vec::new(),
        good_lines: 0,
        bad_lines: 0,
        first_error: None,
    };
    for (i, line) in text.lines().enumerate() {
        match parse_line(line) {
            Ok(None) => {}
            Ok(Some(sample)) => {
                out.good_lines += 1;
                if keep(sample.name) {
                    out.samples.push(sample);
                }
            }
            Err(reason) => {
                out.bad_lines += 1;
                if out.first_error.is_none() {
                    out.first_error = Some(ParseError {
                        line: i + 1,
                        reason,
                    });
                }
            }
        }
    }
    if out.good_lines == 0 || out.bad_lines > out.good_lines {
        return Err(out.first_error.unwrap_or(ParseError {
            line: 0,
            reason: if text.trim().is_empty() {
                "empty body"
            } else {
                "no samples"
            },
        }));
    }
    Ok(out)
}

/// One line: `Ok(None)` for blanks and comments.
fn parse_line(line: &str) -> Result<Option<Sample<'_>>, &'static str> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return Ok(None);
    }
    let name_len = line
        .bytes()
        .take_while(|b| b.is_ascii_alphanumeric() || *b == b'_' || *b == b':')
        .count();
    let (name, rest) = line
        .split_at_checked(name_len)
        .ok_or("expected a metric name")?;
    if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
        return Err("expected a metric name");
    }
    let rest = rest.trim_start();
    let (raw_labels, rest) = match rest.strip_prefix('{') {
        Some(inner) => {
            let close = scan_labels(inner)?;
            let raw = inner.get(..close).ok_or("unterminated label set")?;
            let after = inner.get(close + 1..).ok_or("unterminated label set")?;
            (raw, after)
        }
        None => ("", rest),
    };
    let mut tokens = rest.split_ascii_whitespace();
    let value_text = tokens.next().ok_or("missing value")?;
    let value = parse_value(value_text).ok_or("value is not a number")?;
    match tokens.next() {
        None => {}
        Some(t) if t.starts_with('#') => {}
        Some(ts) => {
            ts.parse::<f64>()
                .map_err(|_| "unexpected text after the value")?;
            if tokens.next().is_some_and(|t| !t.starts_with('#')) {
                return Err("unexpected text after the timestamp");
            }
        }
    }
    Ok(Some(Sample {
        name,
        raw_labels,
        value,
    }))
}

/// Validates a label block that starts just after `{`; returns the byte
/// index of the closing `}` in `s`.
fn scan_labels(s: &str) -> Result<usize, &'static str> {
    let bytes = s.as_bytes();
    let mut i = 0;
    let skip_ws = |mut i: usize| {
        while bytes.get(i).is_some_and(u8::is_ascii_whitespace) {
            i += 1;
        }
        i
    };
    loop {
        i = skip_ws(i);
        match bytes.get(i) {
            None => return Err("unterminated label set"),
            Some(b'}') => return Ok(i),
            Some(b) if b.is_ascii_alphabetic() || *b == b'_' => {}
            Some(_) => return Err("expected a label name"),
        }
        while bytes
            .get(i)
            .is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_')
        {
            i += 1;
        }
        i = skip_ws(i);
        if bytes.get(i) != Some(&b'=') {
            return Err("expected = after a label name");
        }
        i = skip_ws(i + 1);
        if bytes.get(i) != Some(&b'"') {
            return Err("expected a quoted label value");
        }
        i += 1;
        loop {
            match bytes.get(i) {
                None => return Err("unterminated label value"),
                Some(b'\\') => i += 2,
                Some(b'"') => break,
                Some(_) => i += 1,
            }
        }
        i = skip_ws(i + 1);
        match bytes.get(i) {
            Some(b',') => i += 1,
            Some(b'}') => return Ok(i),
            None => return Err("unterminated label set"),
            Some(_) => return Err("expected , or } after a label value"),
        }
    }
}

/// Index of the first unescaped `"` in `s`.
fn closing_quote(s: &str) -> Option<usize> {
    let bytes = s.as_bytes();
    let mut i = 0;
    loop {
        match bytes.get(i)? {
            b'\\' => i += 2,
            b'"' => return Some(i),
            _ => i += 1,
        }
    }
}

fn unescape(raw: &str) -> Cow<'_, str> {
    if !raw.contains('\\') {
        return Cow::Borrowed(raw);
    }
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('\\') => out.push('\\'),
            Some('"') => out.push('"'),
            // Not an escape the format defines: keep it as written.
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => out.push('\\'),
        }
    }
    Cow::Owned(out)
}

/// A sample value: Go-style `NaN`, `+Inf`, `-Inf`, or a float.
fn parse_value(s: &str) -> Option<f64> {
    match s {
        "NaN" | "nan" => Some(f64::NAN),
        "+Inf" | "Inf" | "+inf" | "inf" => Some(f64::INFINITY),
        "-Inf" | "-inf" => Some(f64::NEG_INFINITY),
        _ => s.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(text: &str) -> Exposition<'_> {
        parse(text, |_| true).unwrap()
    }

    #[test]
    fn names_with_colons_labels_and_comments() {
        let text = "# HELP vllm:num_requests_waiting Number of requests waiting.\n\
                    # TYPE vllm:num_requests_waiting gauge\n\
                    vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3.0\n\
                    \n\
                    plain_total 7 1700000000000\n\
                    spaced { a = \"1\" , b=\"2\", } 1e3\n";
        let e = all(text);
        assert_eq!(e.samples.len(), 3);
        assert_eq!(e.bad_lines, 0);
        let s = &e.samples[0];
        assert_eq!(s.name, "vllm:num_requests_waiting");
        assert_eq!(s.value, 3.0);
        assert_eq!(s.label("model_name").as_deref(), Some("m"));
        assert_eq!(s.label("engine").as_deref(), Some("0"));
        assert_eq!(s.label("absent"), None);
        assert_eq!(e.samples[1].name, "plain_total");
        assert_eq!(e.samples[1].labels().count(), 0);
        let l: Vec<_> = e.samples[2].labels().collect();
        assert_eq!(l, vec![("a", "1".into()), ("b", "2".into())]);
        assert_eq!(e.samples[2].value, 1000.0);
    }

    #[test]
    fn label_values_with_commas_equals_braces_and_escapes() {
        let text = r#"x{running_lora_adapters="a,b",q="k=v}",e="say \"hi\"\\n\n",u="ünï"} 1"#;
        let e = all(text);
        let s = &e.samples[0];
        assert_eq!(s.label("running_lora_adapters").as_deref(), Some("a,b"));
        assert_eq!(s.label("q").as_deref(), Some("k=v}"));
        assert_eq!(s.label("e").as_deref(), Some("say \"hi\"\\n\n"));
        assert_eq!(s.label("u").as_deref(), Some("ünï"));
    }

    #[test]
    fn special_values() {
        let e = all("a NaN\nb +Inf\nc -Inf\nd -0.5\ne 1.5e-3\n");
        let v: Vec<f64> = e.samples.iter().map(|s| s.value).collect();
        assert!(v[0].is_nan());
        assert_eq!(&v[1..], &[f64::INFINITY, f64::NEG_INFINITY, -0.5, 0.0015]);
    }

    #[test]
    fn openmetrics_exemplars_and_eof() {
        let e = all("a_bucket{le=\"1\"} 3 # {trace_id=\"x\"} 0.5\nb 1 123 # {t=\"y\"} 1\n# EOF\n");
        assert_eq!(e.samples.len(), 2);
        assert_eq!(e.bad_lines, 0);
    }

    #[test]
    fn keep_filters_without_hiding_validity() {
        let e = parse("vllm:a 1\nother 2\nvllm:b 3\n", |n| n.starts_with("vllm:")).unwrap();
        assert_eq!(e.samples.len(), 2);
        assert_eq!(e.good_lines, 3);
    }

    #[test]
    fn bad_lines_are_skipped_and_counted() {
        let e = all("good 1\nbad{x=1} 2\nalso_good 3\n");
        assert_eq!(e.samples.len(), 2);
        assert_eq!(e.bad_lines, 1);
        assert_eq!(
            e.first_error,
            Some(ParseError {
                line: 2,
                reason: "expected a quoted label value"
            })
        );
    }

    #[test]
    fn garbage_is_rejected_with_a_line() {
        let cases = [
            ("", "empty body"),
            ("   \n\n", "empty body"),
            ("# only comments\n", "no samples"),
            (
                "<html><body>Not Found</body></html>\n",
                "line 1: expected a metric name",
            ),
            ("{\"error\": \"nope\"}", "line 1: expected a metric name"),
            ("Not Found\n", "line 1: value is not a number"),
            ("name_only\n", "line 1: missing value"),
            (
                "a{b=\"c\" 1\n",
                "line 1: expected , or } after a label value",
            ),
            ("a{b=\"c} 1\n", "line 1: unterminated label value"),
            ("a 1 2 3\n", "line 1: unexpected text after the timestamp"),
            ("a 1 xyz\n", "line 1: unexpected text after the value"),
            ("9abc 1\n", "line 1: expected a metric name"),
            ("ok 1\nx y\nz w\n", "line 2: value is not a number"),
        ];
        for (text, want) in cases {
            let err = parse(text, |_| true).unwrap_err();
            assert_eq!(err.to_string(), want, "{text:?}");
        }
    }

    #[test]
    fn never_panics_on_odd_bytes() {
        let odd = [
            "a{",
            "a{\"",
            "a{b",
            "a{b=",
            "a{b=\"",
            "a{b=\"\\",
            "a{b=\"\\\"",
            "{}",
            "a{} ",
            "a{}",
            ":",
            ": 1",
            "a\t\t2",
            "a{b=\"1\",,} 2",
            "\u{feff}a 1",
            "a 1 # ",
            "a{b=\"é\\",
        ];
        for text in odd {
            let _ = parse(text, |_| true);
            if let Ok(e) = parse(text, |_| true) {
                for s in &e.samples {
                    let _ = s.labels().count();
                }
            }
        }
    }
}
