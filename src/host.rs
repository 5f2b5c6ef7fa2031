//! Adapters from kvroute-core's host traits to `proxy_wasm::hostcalls`.
//!
//! Every host call returns a `Result`; a failure becomes a domain error or is
//! skipped (a metric that cannot be recorded is not worth a trap). Nothing
//! here unwraps.

use std::cell::RefCell;

use kvroute_core::host::{
    AdmissionCounter, Counter, Gauge, HostError, Metrics, ReplicaCounter, ReplicaGauge, SetError,
    SharedData, ADMISSION_WAIT_MS, OTHER_REPLICAS, REPLICA_SERIES,
};
use proxy_wasm::hostcalls;
use proxy_wasm::types::{MetricType, Status};

/// Per-replica gauge series a worker defines over its life: four times
/// the replicas it reports at once, for replicas replaced over time.
const GAUGE_SERIES: usize = 4 * REPLICA_SERIES;

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
    /// Per-replica series, defined when first counted: `(host metric
    /// name, id)`, at most `REPLICA_SERIES` replicas per counter plus the
    /// `other` series (the tally already caps them; this holds whatever
    /// calls it).
    series: RefCell<Vec<(String, Option<u32>)>>,
    /// Per-replica gauges, defined when first set: `(host metric name,
    /// id, last value set)`, at most `GAUGE_SERIES` over the VM's life (a
    /// metric cannot be removed; a replica that left reads 0, and past the
    /// cap new replicas get no series); a value is handed to the host only
    /// when it changes.
    gauge_series: RefCell<Vec<(String, Option<u32>, u64)>>,
    /// Admission counters by objective slot (the default, then the
    /// configured objectives), by `AdmissionCounter::ALL`; defined only
    /// when admission control is on.
    admission: Vec<[Option<u32>; AdmissionCounter::ALL.len()]>,
    wait: Option<u32>,
}

fn define(kind: MetricType, name: &str) -> Option<u32> {
    match hostcalls::define_metric(kind, name) {
        Ok(id) => Some(id),
        Err(e) => {
            log::warn!("kvroute: cannot define metric {name}: {e:?}");
            None
        }
    }
}

impl HostMetrics {
    /// Defines every kvroute metric; one that the host refuses is left out
    /// and logged. `objectives` names the admission series (none when
    /// admission control is off).
    pub fn define(objectives: &[&str]) -> HostMetrics {
        HostMetrics {
            admission: objectives
                .iter()
                .map(|o| AdmissionCounter::ALL.map(|c| define(MetricType::Counter, &c.series(o))))
                .collect(),
            wait: (!objectives.is_empty())
                .then(|| define(MetricType::Histogram, ADMISSION_WAIT_MS))
                .flatten(),
            counters: Counter::ALL
                .iter()
                .map(|c| define(MetricType::Counter, c.name()))
                .collect(),
            gauges: Gauge::ALL
                .iter()
                .map(|g| define(MetricType::Gauge, g.name()))
                .collect(),
            series: RefCell::new(Vec::new()),
            gauge_series: RefCell::new(Vec::new()),
        }
    }

    /// The id of a replica's series, defined on first use.
    fn series_id(&self, c: ReplicaCounter, replica: &str) -> Option<u32> {
        let mut series = self.series.try_borrow_mut().ok()?;
        let name = c.series(replica);
        if let Some((_, id)) = series.iter().find(|(n, _)| *n == name) {
            return *id;
        }
        let cap = (REPLICA_SERIES + 1) * ReplicaCounter::ALL.len();
        let name = if series.len() >= cap {
            let other = c.series(OTHER_REPLICAS);
            if let Some((_, id)) = series.iter().find(|(n, _)| *n == other) {
                return *id;
            }
            other
        } else {
            name
        };
        let id = define(MetricType::Counter, &name);
        series.push((name, id));
        id
    }

    fn counter_id(&self, c: Counter) -> Option<u32> {
        let i = Counter::ALL.iter().position(|x| *x == c)?;
        self.counters.get(i).copied().flatten()
    }

    fn gauge_id(&self, g: Gauge) -> Option<u32> {
        let i = Gauge::ALL.iter().position(|x| *x == g)?;
        self.gauges.get(i).copied().flatten()
    }

    /// Adds `delta` to a gauge (Envoy sums every worker's changes).
    pub fn gauge_add(&self, g: Gauge, delta: i64) {
        if let (Some(id), true) = (self.gauge_id(g), delta != 0) {
            let _ = hostcalls::increment_metric(id, delta);
        }
    }

    /// Adds to one objective's admission counter (`slot` as in
    /// `admit::Objective::slot`).
    pub fn count_admission(&self, slot: usize, c: AdmissionCounter, n: u64) {
        let i = AdmissionCounter::ALL.iter().position(|x| *x == c);
        let id = i.and_then(|i| {
            self.admission
                .get(slot)
                .and_then(|ids| ids.get(i).copied().flatten())
        });
        if let (Some(id), true) = (id, n > 0) {
            let _ = hostcalls::increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// Records how long a held request waited.
    pub fn record_wait(&self, ms: u64) {
        if let Some(id) = self.wait {
            let _ = hostcalls::record_metric(id, ms);
        }
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

    fn count_replica(&self, c: ReplicaCounter, replica: &str, n: u64) {
        if let Some(id) = self.series_id(c, replica) {
            let _ = hostcalls::increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    fn gauge_replica(&self, g: ReplicaGauge, replica: &str, v: u64) {
        let Ok(mut series) = self.gauge_series.try_borrow_mut() else {
            return;
        };
        let name = g.series(replica);
        let row = match series.iter().position(|(n, _, _)| *n == name) {
            Some(i) => i,
            None if series.len() < GAUGE_SERIES => {
                let id = define(MetricType::Gauge, &name);
                // u64::MAX: never set, so the first value is recorded.
                series.push((name, id, u64::MAX));
                series.len() - 1
            }
            None => return,
        };
        if let Some((_, Some(id), last)) = series.get_mut(row) {
            if *last != v {
                *last = v;
                let _ = hostcalls::record_metric(*id, v);
            }
        }
    }
}
