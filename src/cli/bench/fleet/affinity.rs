//! Where the keyed conversations' turns ran: each result's `affinity` record says whether a
//! turn ran on its key's worker (`held`) or why not (`fallback`), and its `worker_id` where it
//! ran, so the hit rate is read from the fleet's own records, in steady state and while a
//! disruption was in progress.

use std::collections::HashMap;

use serde::Serialize;

use super::accounting::{Counted, End};
use super::disruptions::Disruption;
use super::lanes::Turn;

#[derive(Debug, Clone, Default, Serialize)]
pub struct AffinityFigures {
    /// Turns the keyed lanes sent.
    pub turns: u64,
    /// Turns whose result carries an affinity record.
    pub recorded: u64,
    /// ... that ran on their key's worker.
    pub held: u64,
    /// ... that went elsewhere: the key's worker had no free slot or was gone.
    pub fallback_busy: u64,
    /// ... the key's worker was over the load bound.
    pub fallback_load: u64,
    /// ... that nobody placed (no key's worker named).
    pub unplaced: u64,
    /// Turns after a conversation's first whose turn before ran on the same worker.
    pub later_turns: u64,
    pub same_worker_as_turn_before: u64,
    /// Turns whose result is not known in full (not ended, or known only from a summary).
    pub without_result: u64,
    /// `held` ÷ `recorded`, over the run, in steady state, during disruptions.
    pub hit_rate: Option<f64>,
    pub hit_rate_steady: Option<f64>,
    pub hit_rate_disrupted: Option<f64>,
}

pub fn figures(turns: &[Turn], counted: &[Counted], disruptions: &[Disruption]) -> AffinityFigures {
    let results: HashMap<&str, &End> = counted
        .iter()
        .filter_map(|c| Some((c.id.as_str(), c.end.as_ref()?)))
        .collect();
    let worker_of = |id: &str| {
        results
            .get(id)
            .and_then(|end| end.result())
            .map(|r| r.worker_id.clone())
    };
    let mut f = AffinityFigures::default();
    let (mut steady, mut disrupted) = ((0u64, 0u64), (0u64, 0u64));
    // The turn before each, by conversation.
    let mut before: HashMap<&str, &Turn> = HashMap::new();
    let mut ordered: Vec<&Turn> = turns.iter().collect();
    ordered.sort_by(|a, b| a.key.cmp(&b.key).then(a.turn.cmp(&b.turn)));
    for turn in ordered {
        f.turns += 1;
        let previous = before.insert(&turn.key, turn);
        let Some(result) = results.get(turn.id.as_str()).and_then(|end| end.result()) else {
            f.without_result += 1;
            continue;
        };
        if let Some(previous) = previous.filter(|p| p.turn + 1 == turn.turn) {
            f.later_turns += 1;
            f.same_worker_as_turn_before +=
                u64::from(worker_of(&previous.id).as_deref() == Some(result.worker_id.as_str()));
        }
        let Some(record) = &result.affinity else {
            continue;
        };
        f.recorded += 1;
        f.held += u64::from(record.held);
        f.fallback_busy += u64::from(record.fallback.as_deref() == Some("busy"));
        f.fallback_load += u64::from(record.fallback.as_deref() == Some("load"));
        f.unplaced += u64::from(record.preferred_worker.is_none());
        let window = if disruptions.iter().any(|d| d.covers(turn.submitted_s)) {
            &mut disrupted
        } else {
            &mut steady
        };
        window.0 += 1;
        window.1 += u64::from(record.held);
    }
    let rate = |(of, held): (u64, u64)| (of > 0).then(|| held as f64 / of as f64);
    f.hit_rate = rate((f.recorded, f.held));
    f.hit_rate_steady = rate(steady);
    f.hit_rate_disrupted = rate(disrupted);
    f
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{AffinityRecord, GenerationResult, RequestState};

    fn turn(id: &str, key: &str, turn: usize, at: f64) -> Turn {
        Turn {
            id: id.into(),
            key: key.into(),
            turn,
            submitted_s: at,
        }
    }

    fn ran(id: &str, worker: &str, held: bool, fallback: Option<&str>) -> Counted {
        let mut result =
            GenerationResult::empty(id, crate::protocol::Reason::Stop, String::new(), worker);
        result.state = RequestState::Completed;
        result.affinity = Some(AffinityRecord {
            key: "k".into(),
            preferred_worker: Some("w1".into()),
            held,
            fallback: fallback.map(str::to_string),
        });
        Counted {
            id: id.into(),
            kind: super::super::lanes::Kind::KeyedBus,
            accepted: true,
            end: Some(End::Event(Box::new(result))),
            finished_events: 1,
            seq_fault: false,
            delta_mismatch: false,
            side_by_side: Vec::new(),
            told: None,
        }
    }

    #[test]
    fn the_hit_rate_is_read_from_the_results_records_by_window() {
        let turns = [
            turn("a0", "a", 0, 1.0),
            turn("a1", "a", 1, 2.0),
            turn("a2", "a", 2, 12.0),
            turn("b0", "b", 0, 13.0),
        ];
        let counted = [
            ran("a0", "w1", true, None),
            ran("a1", "w1", true, None),
            ran("a2", "w2", false, Some("busy")),
        ];
        let disruptions = [Disruption {
            kind: super::super::disruptions::DisruptionKind::GatewayKilled,
            label: "gateway-2 killed".into(),
            started_s: 10.0,
            ended_s: 12.5,
            steps: vec![],
        }];
        let f = figures(&turns, &counted, &disruptions);
        assert_eq!((f.turns, f.recorded, f.held, f.fallback_busy), (4, 3, 2, 1));
        assert_eq!(f.without_result, 1);
        assert_eq!((f.later_turns, f.same_worker_as_turn_before), (2, 1));
        assert_eq!(f.hit_rate_steady, Some(1.0));
        assert_eq!(f.hit_rate_disrupted, Some(0.0));
    }
}
