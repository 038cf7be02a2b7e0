//! The Prometheus text format as the bench reads a worker's `/metrics`: each sample's value by
//! its metric name, the samples of one name summed over their label sets. Comments, blank
//! lines and lines that are not a sample are skipped, so a name a worker does not serve is
//! simply absent (a gauge added in a later release is read once it is there, and a worker of
//! an earlier one reads as not having it).

use std::collections::BTreeMap;

/// Every metric of `text` by name, its samples summed over their label sets (a histogram's
/// `_bucket`, `_sum` and `_count` are names of their own).
pub fn sums(text: &str) -> BTreeMap<String, f64> {
    let mut sums = BTreeMap::new();
    for line in text.lines() {
        if let Some((name, value)) = sample(line) {
            *sums.entry(name.to_string()).or_insert(0.0) += value;
        }
    }
    sums
}

/// The name and value of one sample line: `name value [timestamp]` or
/// `name{label="value",...} value [timestamp]`; `None` for anything else.
fn sample(line: &str) -> Option<(&str, f64)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    {
        return None;
    }
    let mut rest = &line[name_end..];
    if rest.starts_with('{') {
        rest = &rest[labels_end(rest)?..];
    }
    let value = rest.split_whitespace().next()?.parse::<f64>().ok()?;
    Some((name, value))
}

/// The index just past the `}` that closes the label set `text` starts with; a label value is
/// a quoted string in which `\"`, `\\` and `\n` are escapes and `}` may appear.
fn labels_end(text: &str) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in text.char_indices().skip(1) {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return Some(i + 1),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_summed_by_name_over_their_labels() {
        let text = r#"# HELP genfleet_slots_total Slots of this worker.
# TYPE genfleet_slots_total gauge
genfleet_slots_total 4
genfleet_slots_busy 3

genfleet_pool_slots{pool="default"} 16
genfleet_tenant_running{tenant="a",band="low"} 2
genfleet_tenant_running{tenant="b}{ \"odd\"",band="high"} 1.5 1712345678000
genfleet_request_seconds_bucket{le="+Inf"} 7
not a sample line
genfleet_broken{tenant="a" 3
genfleet_nan NaN
"#;
        let sums = sums(text);
        let get = |name: &str| sums.get(name).copied();
        assert_eq!(get("genfleet_slots_total"), Some(4.0));
        assert_eq!(get("genfleet_slots_busy"), Some(3.0));
        assert_eq!(get("genfleet_pool_slots"), Some(16.0));
        assert_eq!(get("genfleet_tenant_running"), Some(3.5));
        assert_eq!(get("genfleet_request_seconds_bucket"), Some(7.0));
        assert_eq!(get("genfleet_broken"), None);
        assert!(get("genfleet_nan").is_some_and(f64::is_nan));
        assert_eq!(
            get("genfleet_queue_pending"),
            None,
            "absent names stay absent"
        );
        assert_eq!(get("not"), None);
    }

    #[test]
    fn a_real_workers_metrics_read_as_prometheus_reads_them() {
        // The worker's own registry, read by this parser and by a full Prometheus parser.
        let metrics = crate::observe::metrics::Metrics::new();
        metrics.slots_total.set(8);
        metrics.slots_busy.set(5);
        metrics.queue_pending.set(12);
        let text = metrics.encode();
        let ours = sums(&text);
        let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string())))
            .expect("Prometheus text parses");
        for name in [
            "genfleet_slots_total",
            "genfleet_slots_busy",
            "genfleet_queue_pending",
        ] {
            let theirs: f64 = scrape
                .samples
                .iter()
                .filter(|s| s.metric == name)
                .map(|s| match s.value {
                    prometheus_parse::Value::Gauge(v)
                    | prometheus_parse::Value::Counter(v)
                    | prometheus_parse::Value::Untyped(v) => v,
                    _ => 0.0,
                })
                .sum();
            assert_eq!(ours.get(name).copied(), Some(theirs), "{name}");
        }
        assert_eq!(ours.get("genfleet_queue_pending"), Some(&12.0));
    }
}
