//! A manager's answer to a decision: the option chosen and what may come with it. It arrives
//! on `decisions.<decision_id>`, and the same choice is what the decision's record, the
//! decision history and the suggestions offered to later managers carry (flattened into each,
//! so each keeps its own flat JSON).

use serde::{Deserialize, Serialize};

/// The choice, as a manager sends it on `decisions.<decision_id>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecisionAnswer {
    pub option_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rationale: Option<String>,
    /// Who answered (`human:<name>`, `manager:<name>`, `timeout`); filled in by the manager
    /// that sends the answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_by: Option<String>,
    /// A new prompt for the continuation (option `modify_prompt` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modified_prompt: Option<String>,
    /// A note the continuation gets after the decision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guidance: Option<String>,
    /// Lowers the continuation's escalation threshold, 0 to 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confidence_boost: Option<f64>,
}

impl DecisionAnswer {
    /// Just an option, with nothing else said yet.
    pub fn option(option_id: impl Into<String>) -> DecisionAnswer {
        DecisionAnswer {
            option_id: option_id.into(),
            rationale: None,
            decided_by: None,
            modified_prompt: None,
            guidance: None,
            confidence_boost: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A record that carries the choice among fields of its own, as the decision record does.
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Carrier {
        #[serde(flatten)]
        choice: DecisionAnswer,
        outcome: String,
    }

    #[test]
    fn alone_it_refuses_unknown_fields() {
        let answer: DecisionAnswer =
            serde_json::from_value(json!({"option_id": "fast", "confidence_boost": 1})).unwrap();
        assert_eq!(answer.confidence_boost, Some(1.0));
        assert!(
            serde_json::from_value::<DecisionAnswer>(json!({"option_id": "a", "x": 1})).is_err()
        );
    }

    #[test]
    fn flattened_it_keeps_the_fields_flat_and_in_order() {
        let carrier = Carrier {
            choice: DecisionAnswer {
                rationale: Some("deadline".into()),
                confidence_boost: Some(0.25),
                ..DecisionAnswer::option("fast")
            },
            outcome: "continued".into(),
        };
        let text = serde_json::to_string(&carrier).unwrap();
        assert_eq!(
            text,
            r#"{"option_id":"fast","rationale":"deadline","confidence_boost":0.25,"outcome":"continued"}"#
        );
        assert_eq!(serde_json::from_str::<Carrier>(&text).unwrap(), carrier);
        // The carrier's own fields and ones it does not know are not the choice's business.
        let read: Carrier = serde_json::from_value(
            json!({"outcome": "skipped", "option_id": "skip", "decided_by": null, "later": 1}),
        )
        .unwrap();
        assert_eq!(read.choice, DecisionAnswer::option("skip"));
        let encoded = rmp_serde::to_vec_named(&carrier).unwrap();
        assert_eq!(rmp_serde::from_slice::<Carrier>(&encoded).unwrap(), carrier);
    }
}
