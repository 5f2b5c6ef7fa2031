//! Injected faults, for reliability tests.
//!
//! `--fault SPEC`, with SPEC a comma-separated list of `key=value`:
//!
//! | key | value |
//! |---|---|
//! | `engine` | engine index (0-based) |
//! | `kind` | `die`, `stall` or `error` |
//! | `at` | when, modelled time from start: `30s`, `500ms` or seconds (`1.5`) |
//! | `for` | how long (`stall`, `error`); same units |
//!
//! * `die`: the engine stops listening and closes its connections (streams
//!   in flight are cut); the other engines keep going.
//! * `stall`: the scheduler stops stepping and no HTTP request gets an
//!   answer for the duration (they hang, then go on).
//! * `error`: completions answer 503 with a JSON error, and `/health`
//!   answers 503, for the duration.

/// What goes wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    Die,
    Stall,
    Error,
}

impl FaultKind {
    /// Parses `die`, `stall` or `error`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "die" => Some(Self::Die),
            "stall" => Some(Self::Stall),
            "error" => Some(Self::Error),
            _ => None,
        }
    }
}

/// One scheduled fault.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultSpec {
    pub engine: usize,
    pub kind: FaultKind,
    /// Modelled seconds from start.
    pub at_s: f64,
    /// Modelled seconds (0 for `die`).
    pub for_s: f64,
}

/// Parses `30s`, `500ms` or a plain number of seconds.
fn seconds(v: &str) -> Option<f64> {
    let v = v.trim();
    let x = if let Some(ms) = v.strip_suffix("ms") {
        ms.trim().parse::<f64>().ok()? / 1000.0
    } else if let Some(s) = v.strip_suffix('s') {
        s.trim().parse::<f64>().ok()?
    } else {
        v.parse::<f64>().ok()?
    };
    (x.is_finite() && x >= 0.0).then_some(x)
}

impl std::str::FromStr for FaultSpec {
    type Err = String;

    fn from_str(spec: &str) -> Result<Self, String> {
        let (mut engine, mut kind, mut at, mut dur) = (None, None, None, None);
        for part in spec.split(',').filter(|p| !p.trim().is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("fault {spec:?}: {part:?} is not key=value"))?;
            let bad = |why: &str| format!("fault {spec:?}: {k}={v:?}: {why}");
            match k.trim() {
                "engine" => {
                    engine = Some(v.trim().parse::<usize>().map_err(|_| bad("not an index"))?)
                }
                "kind" => {
                    kind =
                        Some(FaultKind::parse(v.trim()).ok_or_else(|| bad("not die|stall|error"))?)
                }
                "at" => at = Some(seconds(v).ok_or_else(|| bad("not a duration"))?),
                "for" => dur = Some(seconds(v).ok_or_else(|| bad("not a duration"))?),
                _ => return Err(bad("unknown key (engine, kind, at, for)")),
            }
        }
        let engine = engine.ok_or_else(|| format!("fault {spec:?}: engine= missing"))?;
        let kind = kind.ok_or_else(|| format!("fault {spec:?}: kind= missing"))?;
        let for_s = match (kind, dur) {
            (FaultKind::Die, _) => 0.0,
            (_, Some(d)) => d,
            (_, None) => return Err(format!("fault {spec:?}: for= missing")),
        };
        Ok(Self {
            engine,
            kind,
            at_s: at.unwrap_or(0.0),
            for_s,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn parses_specs() {
        let f: FaultSpec = "engine=2,kind=stall,at=10s,for=500ms".parse().unwrap();
        assert_eq!(
            f,
            FaultSpec {
                engine: 2,
                kind: FaultKind::Stall,
                at_s: 10.0,
                for_s: 0.5
            }
        );
        let d: FaultSpec = "engine=1,kind=die,at=30".parse().unwrap();
        assert_eq!(d.kind, FaultKind::Die);
        assert!((d.at_s - 30.0).abs() < 1e-12);
        assert!("engine=1,kind=error,at=1s".parse::<FaultSpec>().is_err());
        assert!("engine=1,kind=boom".parse::<FaultSpec>().is_err());
        assert!("kind=die".parse::<FaultSpec>().is_err());
        assert!("engine=0,kind=die,at=-1".parse::<FaultSpec>().is_err());
    }
}
