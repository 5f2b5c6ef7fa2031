//! Adapters from kvroute-core's host traits to `proxy_wasm::hostcalls`.
//!
//! Every host call returns a `Result`; a failure becomes a domain error or is
//! skipped (a metric that cannot be recorded is not worth a trap). Nothing
//! here unwraps.

use kvroute_core::host::{Counter, Gauge, HostError, Metrics, SetError, SharedData};
use proxy_wasm::hostcalls;
use proxy_wasm::types::{MetricType, Status};

/// Envoy's shared data for this VM id.
pub struct HostSharedData;

impl SharedData for HostSharedData {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), HostError> {
        hostcalls::get_shared_data(key).map_err(|_| HostError)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(SetError::CasMismatch),
            Err(_) => Err(SetError::Host),
        }
    }
}

/// Metric ids, defined once per VM when the plugin is configured.
pub struct HostMetrics {
    counters: Vec<Option<u32>>,
    gauges: Vec<Option<u32>>,
}

impl HostMetrics {
    /// Defines every kvroute metric; one that the host refuses is left out
    /// and logged.
    pub fn define() -> HostMetrics {
        let define = |kind: MetricType, name: &str| match hostcalls::define_metric(kind, name) {
            Ok(id) => Some(id),
            Err(e) => {
                log::warn!("kvroute: cannot define metric {name}: {e:?}");
                None
            }
        };
        HostMetrics {
            counters: Counter::ALL
                .iter()
                .map(|c| define(MetricType::Counter, c.name()))
                .collect(),
            gauges: Gauge::ALL
                .iter()
                .map(|g| define(MetricType::Gauge, g.name()))
                .collect(),
        }
    }

    fn counter_id(&self, c: Counter) -> Option<u32> {
        let i = Counter::ALL.iter().position(|x| *x == c)?;
        self.counters.get(i).copied().flatten()
    }

    fn gauge_id(&self, g: Gauge) -> Option<u32> {
        let i = Gauge::ALL.iter().position(|x| *x == g)?;
        self.gauges.get(i).copied().flatten()
    }
}

impl Metrics for HostMetrics {
    fn count(&self, c: Counter, n: u64) {
        if let Some(id) = self.counter_id(c) {
            let _ = hostcalls::increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    fn gauge(&self, g: Gauge, v: u64) {
        if let Some(id) = self.gauge_id(g) {
            let _ = hostcalls::record_metric(id, v);
        }
    }
}
