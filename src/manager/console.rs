//! The interactive console: a person answers decisions one at a time.
//!
//! [`Console`] is plain blocking I/O over any `BufRead` and `Write`, so it is tested with
//! scripted input. [`ConsoleHandle`] runs one on a thread of its own (reading standard input
//! blocks, and a read cannot be cancelled) and hands it one decision at a time.
//!
//! For each decision the console shows everything it knows (see [`DecisionView::render`]),
//! then asks for the choice (a number or an option id; Enter takes the default when there is
//! one; `s` leaves the decision unanswered), an optional rationale and, for escalations and
//! checkpoints, a new prompt when the choice is `modify_prompt`, optional guidance and (for
//! escalations) an optional confidence boost. Every answer is one line. The end of the input
//! closes the console: later decisions are left unanswered.

use std::io::{self, BufRead, Write};

use tokio::sync::{mpsc, oneshot};

use super::view::DecisionView;
use crate::protocol::{DecisionAnswer, DecisionKind};

/// The option id whose answer carries a replacement prompt.
pub const MODIFY_PROMPT: &str = "modify_prompt";
/// Options of escalations and checkpoints that end the chain: the fleet takes no guidance or
/// confidence boost with them.
pub const CHAIN_ENDING_OPTIONS: &[&str] = &["skip", "abort"];

#[derive(Debug, Clone, PartialEq)]
pub enum ConsoleVerdict {
    /// What the person answered; who they are (`decided_by`) is the manager's to fill in.
    Answer(DecisionAnswer),
    /// Left unanswered on purpose (`s`).
    Skip,
    /// The input ended (or failed): nothing more can be asked.
    Closed(String),
}

/// A console on a reader and a writer.
pub struct Console<R, W> {
    input: R,
    output: W,
}

impl<R: BufRead, W: Write> Console<R, W> {
    pub fn new(input: R, output: W) -> Console<R, W> {
        Console { input, output }
    }

    /// The reader and writer back (tests read what was written).
    pub fn into_parts(self) -> (R, W) {
        (self.input, self.output)
    }

    /// Shows one decision and reads the answer to it.
    pub fn ask(&mut self, view: &DecisionView) -> io::Result<ConsoleVerdict> {
        let mut text = String::from("\n");
        text.push_str(&view.render());
        self.output.write_all(text.as_bytes())?;
        let option_id = match self.read_choice(view)? {
            Choice::Option(id) => id,
            Choice::Skip => {
                writeln!(self.output, "Left unanswered.")?;
                self.output.flush()?;
                return Ok(ConsoleVerdict::Skip);
            }
            Choice::EndOfInput => return Ok(ConsoleVerdict::Closed("end of input".into())),
        };
        let mut answer = DecisionAnswer::option(option_id);
        let Some(rationale) = self.read_line("Rationale (optional): ")? else {
            return Ok(ConsoleVerdict::Closed("end of input".into()));
        };
        answer.rationale = non_empty(rationale);
        if view.takes_extras() && !CHAIN_ENDING_OPTIONS.contains(&answer.option_id.as_str()) {
            if answer.option_id == MODIFY_PROMPT {
                loop {
                    let Some(prompt) =
                        self.read_line("New prompt (replaces the last user message): ")?
                    else {
                        return Ok(ConsoleVerdict::Closed("end of input".into()));
                    };
                    if let Some(prompt) = non_empty(prompt) {
                        answer.modified_prompt = Some(prompt);
                        break;
                    }
                    writeln!(self.output, "modify_prompt needs the new prompt.")?;
                }
            }
            let Some(guidance) = self.read_line("Guidance for the next attempt (optional): ")?
            else {
                return Ok(ConsoleVerdict::Closed("end of input".into()));
            };
            answer.guidance = non_empty(guidance);
            if view.decision.kind == DecisionKind::Escalation {
                loop {
                    let Some(boost) = self
                        .read_line("Confidence boost (optional, 0 to 1, lowers the threshold): ")?
                    else {
                        return Ok(ConsoleVerdict::Closed("end of input".into()));
                    };
                    let Some(boost) = non_empty(boost) else { break };
                    match boost.parse::<f64>() {
                        Ok(b) if (0.0..=1.0).contains(&b) => {
                            answer.confidence_boost = Some(b);
                            break;
                        }
                        _ => writeln!(self.output, "Not a number from 0 to 1: {boost}")?,
                    }
                }
            }
        }
        Ok(ConsoleVerdict::Answer(answer))
    }

    fn read_choice(&mut self, view: &DecisionView) -> io::Result<Choice> {
        let options = &view.decision.options;
        let default = view.decision.default_option.as_deref();
        let enter = match default {
            Some(d) => format!("Enter: {d}; "),
            None => String::new(),
        };
        let prompt = format!(
            "Choose 1-{} or an option id ({enter}s: leave it unanswered): ",
            options.len()
        );
        loop {
            let Some(line) = self.read_line(&prompt)? else {
                return Ok(Choice::EndOfInput);
            };
            let choice = line.trim();
            if choice.is_empty() {
                match default {
                    Some(d) => return Ok(Choice::Option(d.to_string())),
                    None => {
                        writeln!(
                            self.output,
                            "This decision has no default; choose an option or s."
                        )?;
                        continue;
                    }
                }
            }
            if let Ok(n) = choice.parse::<usize>()
                && (1..=options.len()).contains(&n)
            {
                return Ok(Choice::Option(options[n - 1].id.clone()));
            }
            if let Some(option) = options.iter().find(|o| o.id == choice) {
                return Ok(Choice::Option(option.id.clone()));
            }
            if choice.eq_ignore_ascii_case("s") {
                return Ok(Choice::Skip);
            }
            writeln!(self.output, "Not an option: {choice}")?;
        }
    }

    /// One line without its line end; `None` at the end of the input.
    fn read_line(&mut self, prompt: &str) -> io::Result<Option<String>> {
        self.output.write_all(prompt.as_bytes())?;
        self.output.flush()?;
        let mut line = String::new();
        if self.input.read_line(&mut line)? == 0 {
            writeln!(self.output)?;
            return Ok(None);
        }
        Ok(Some(line.trim_end_matches(['\n', '\r']).to_string()))
    }
}

/// The first answer to a decision.
enum Choice {
    Option(String),
    Skip,
    EndOfInput,
}

fn non_empty(text: String) -> Option<String> {
    let trimmed = text.trim();
    (!trimmed.is_empty()).then(|| trimmed.to_string())
}

struct Job {
    view: DecisionView,
    reply: oneshot::Sender<ConsoleVerdict>,
}

/// A console running on its own thread. Cheap to clone; all clones talk to the one console,
/// which handles one decision at a time.
#[derive(Clone)]
pub struct ConsoleHandle {
    jobs: mpsc::Sender<Job>,
}

impl ConsoleHandle {
    /// The console on standard input and standard output.
    pub fn stdio() -> io::Result<ConsoleHandle> {
        ConsoleHandle::spawn(Console::new(io::BufReader::new(io::stdin()), io::stdout()))
    }

    /// Runs `console` on a thread of its own. The thread is not joined: a read blocked on a
    /// terminal cannot be interrupted, and the process may end while it waits.
    pub fn spawn<R, W>(mut console: Console<R, W>) -> io::Result<ConsoleHandle>
    where
        R: BufRead + Send + 'static,
        W: Write + Send + 'static,
    {
        let (jobs, mut queue) = mpsc::channel::<Job>(1);
        std::thread::Builder::new()
            .name("genfleet-console".into())
            .spawn(move || {
                let mut closed: Option<String> = None;
                while let Some(job) = queue.blocking_recv() {
                    let verdict = match &closed {
                        Some(reason) => ConsoleVerdict::Closed(reason.clone()),
                        None => match console.ask(&job.view) {
                            Ok(verdict) => verdict,
                            Err(error) => ConsoleVerdict::Closed(format!("console error: {error}")),
                        },
                    };
                    if let ConsoleVerdict::Closed(reason) = &verdict {
                        closed = Some(reason.clone());
                    }
                    let _ = job.reply.send(verdict);
                }
            })?;
        Ok(ConsoleHandle { jobs })
    }

    /// Asks the person; waits for as long as they take.
    pub async fn ask(&self, view: DecisionView) -> ConsoleVerdict {
        let (reply, answer) = oneshot::channel();
        if self.jobs.send(Job { view, reply }).await.is_err() {
            return ConsoleVerdict::Closed("the console stopped".into());
        }
        answer
            .await
            .unwrap_or_else(|_| ConsoleVerdict::Closed("the console stopped".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manager::view::tests::escalation;
    use serde_json::json;

    fn model_view() -> DecisionView {
        let mut view = escalation(json!({}));
        view.decision.kind = DecisionKind::Model;
        view
    }

    fn checkpoint_view() -> DecisionView {
        let mut view = escalation(json!({}));
        view.decision.kind = DecisionKind::Checkpoint;
        view.decision.default_option = None;
        view
    }

    /// Runs the console on `input` and returns the verdict and everything it wrote.
    fn check(view: &DecisionView, input: &str) -> (ConsoleVerdict, String) {
        let mut console = Console::new(io::Cursor::new(input.as_bytes().to_vec()), Vec::new());
        let verdict = console.ask(view).unwrap();
        let (_, out) = console.into_parts();
        (verdict, String::from_utf8(out).unwrap())
    }

    fn answer(option: &str) -> DecisionAnswer {
        DecisionAnswer::option(option)
    }

    #[test]
    fn scripted_answers() {
        let with = |f: &dyn Fn(&mut DecisionAnswer), option: &str| {
            let mut a = answer(option);
            f(&mut a);
            ConsoleVerdict::Answer(a)
        };
        let cases: Vec<(&str, DecisionView, &str, ConsoleVerdict)> = vec![
            (
                "a number",
                model_view(),
                "2\n\n",
                ConsoleVerdict::Answer(answer("skip")),
            ),
            (
                "an id, with a rationale",
                model_view(),
                "abort\nno time\n",
                with(&|a| a.rationale = Some("no time".into()), "abort"),
            ),
            (
                "Enter takes the default",
                model_view(),
                "\n\n",
                ConsoleVerdict::Answer(answer("retry")),
            ),
            ("s leaves it", model_view(), "s\n", ConsoleVerdict::Skip),
            (
                "wrong choices are asked again",
                model_view(),
                "9\nwarp\n0\n1\n\n",
                ConsoleVerdict::Answer(answer("retry")),
            ),
            (
                "no default: Enter asks again",
                checkpoint_view(),
                "\n2\n\n\n",
                ConsoleVerdict::Answer(answer("skip")),
            ),
            (
                "modify_prompt asks for the prompt until given",
                checkpoint_view(),
                "4\nclearer\n\nSay it briefly.\nbe brief\n",
                with(
                    &|a| {
                        a.rationale = Some("clearer".into());
                        a.modified_prompt = Some("Say it briefly.".into());
                        a.guidance = Some("be brief".into());
                    },
                    "modify_prompt",
                ),
            ),
            (
                "escalations take a confidence boost",
                escalation(json!({})),
                "1\n\n\nx\n-1\n2\n0.15\n",
                with(&|a| a.confidence_boost = Some(0.15), "retry"),
            ),
            (
                "an option that ends the chain takes no extras",
                escalation(json!({})),
                "2\nnot worth it\n",
                with(&|a| a.rationale = Some("not worth it".into()), "skip"),
            ),
            (
                "the end of input closes",
                model_view(),
                "",
                ConsoleVerdict::Closed("end of input".into()),
            ),
            (
                "the end of input mid-answer closes",
                escalation(json!({})),
                "4\nwhy\n",
                ConsoleVerdict::Closed("end of input".into()),
            ),
        ];
        for (name, view, input, expected) in cases {
            let (verdict, _) = check(&view, input);
            assert_eq!(verdict, expected, "{name}");
        }
    }

    #[test]
    fn the_console_shows_the_decision_and_says_what_went_wrong() {
        let view = escalation(
            json!({"confidence": 0.4, "suggestions": [{"option_id": "retry", "outcome": "COMPLETED", "confidence": 0.8, "prompt": "p"}]}),
        );
        let (_, out) = check(&view, "7\n1\n\n\n\n");
        for needle in [
            "Decision d1",
            "1. retry: Retry  [default]",
            "confidence: 0.4",
            "option retry, outcome COMPLETED, confidence 0.8",
            "Choose 1-4 or an option id (Enter: retry; s: leave it unanswered): ",
            "Not an option: 7",
            "Rationale (optional): ",
            "Guidance for the next attempt (optional): ",
            "Confidence boost",
        ] {
            assert!(out.contains(needle), "{needle:?} in:\n{out}");
        }
        // A model's own decision takes no extras.
        let (_, out) = check(&model_view(), "1\n\n");
        assert!(!out.contains("Guidance"), "{out}");
    }

    #[tokio::test]
    async fn the_handle_asks_one_at_a_time_and_stays_closed_after_the_end() {
        let console = Console::new(io::Cursor::new(b"2\nok\n".to_vec()), io::sink());
        let handle = ConsoleHandle::spawn(console).unwrap();
        let first = handle.ask(model_view()).await;
        assert_eq!(
            first,
            ConsoleVerdict::Answer(DecisionAnswer {
                rationale: Some("ok".into()),
                ..answer("skip")
            })
        );
        assert!(matches!(
            handle.ask(model_view()).await,
            ConsoleVerdict::Closed(_)
        ));
        assert!(matches!(
            handle.ask(model_view()).await,
            ConsoleVerdict::Closed(_)
        ));
    }
}
