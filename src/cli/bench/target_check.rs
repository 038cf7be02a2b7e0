//! A performance target as a run measured it. Phases build these checks and the report shows
//! them; the type lives apart from both so that a phase need not import the report that
//! imports the phase.

use serde::Serialize;

/// One of the project's performance targets, as this run measured it.
#[derive(Debug, Clone, Serialize)]
pub struct TargetCheck {
    pub name: &'static str,
    pub target: &'static str,
    pub value: Option<f64>,
    pub unit: &'static str,
    pub met: Option<bool>,
    /// Whether the run had the target's conditions (concurrency, delay, workers, slots);
    /// `None` when the bench could not tell (a fleet it did not start).
    pub conditions_met: Option<bool>,
}
