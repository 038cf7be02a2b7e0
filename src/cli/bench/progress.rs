//! The progress bar of a phase, on stderr (indicatif hides it when stderr is not a terminal,
//! so `--json` output and logs stay clean).

use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

use super::budget::Budget;

pub struct Progress {
    bar: ProgressBar,
    ticker: tokio::task::JoinHandle<()>,
}

impl Progress {
    /// A bar over the budget's requests, or over its duration when it has no request limit.
    pub fn start(label: &str, budget: Arc<Budget>) -> Progress {
        let (len, template) = match (budget.limit(), budget.duration()) {
            (Some(limit), _) => (
                limit,
                "{prefix:>22} [{bar:30}] {pos}/{len} requests, {elapsed}",
            ),
            (None, Some(duration)) => (
                duration.as_millis() as u64,
                "{prefix:>22} [{bar:30}] {msg} requests, {elapsed}",
            ),
            (None, None) => (0, "{prefix:>22} {msg} requests, {elapsed}"),
        };
        let bar = ProgressBar::new(len);
        bar.set_style(
            ProgressStyle::with_template(template)
                .expect("a valid template")
                .progress_chars("=> "),
        );
        bar.set_prefix(label.to_string());
        let shown = bar.clone();
        let ticker = tokio::spawn(async move {
            loop {
                let done = budget.finished();
                if budget.limit().is_some() {
                    shown.set_position(done);
                } else {
                    shown.set_position(budget.elapsed().as_millis() as u64);
                    shown.set_message(done.to_string());
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        Progress { bar, ticker }
    }

    /// A bar counting `total` items of a phase that does not run on a [`Budget`].
    pub fn counting(label: &str, total: u64) -> ProgressBar {
        let bar = ProgressBar::new(total);
        bar.set_style(
            ProgressStyle::with_template("{prefix:>22} [{bar:30}] {pos}/{len} {msg}, {elapsed}")
                .expect("a valid template")
                .progress_chars("=> "),
        );
        bar.set_prefix(label.to_string());
        bar
    }

    pub fn finish(self) {
        self.ticker.abort();
        self.bar.finish_and_clear();
    }
}
