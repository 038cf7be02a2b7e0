//! The caller's task among a request's messages. A continuation carries its chain's messages
//! plus the notes genfleet adds when a decision is answered (the option chosen, a manager's
//! guidance); whoever wants the task the caller set (the history, the console, an escalation)
//! skips those notes.

use super::{Message, Role};

/// How the notes genfleet adds to a continuation begin; they are not the caller's task.
pub const DECISION_NOTE_PREFIX: &str = "Decision chosen:";
/// How a manager's guidance note begins.
pub const GUIDANCE_NOTE_PREFIX: &str = "Guidance from the manager:";

/// The caller's task: the last user message that is not a note genfleet added.
pub fn task_message_index(messages: &[Message]) -> Option<usize> {
    messages.iter().rposition(|m| {
        m.role == Role::User && {
            let text = m.text();
            !text.starts_with(DECISION_NOTE_PREFIX) && !text.starts_with(GUIDANCE_NOTE_PREFIX)
        }
    })
}

/// The caller's task as text (empty when there is none).
pub fn task_text(messages: &[Message]) -> String {
    task_message_index(messages)
        .map(|i| messages[i].text().into_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_task_is_the_last_user_message_that_is_not_a_note() {
        let messages = vec![
            Message::user("first"),
            Message::assistant("ok"),
            Message::user("the task"),
            Message::user(format!("{DECISION_NOTE_PREFIX} Retry (retry)")),
            Message::user(format!("{GUIDANCE_NOTE_PREFIX} be brief")),
        ];
        assert_eq!(task_message_index(&messages), Some(2));
        assert_eq!(task_text(&messages), "the task");
        assert_eq!(task_text(&[Message::assistant("x")]), "");
    }
}
