//! Progress of a long CLI command (`send` of a large file, `dead-letters`
//! over thousands, `tail --count` with a large count): a count, the rate
//! and the elapsed time on standard error, drawn only where a person
//! watches it. Nothing is drawn when standard error is not a terminal (a
//! pipe, a file, CI), when the command's own lines go to the same terminal
//! on standard output (they would be drawn over), or with `--quiet`.

use std::io::IsTerminal as _;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How often the line is redrawn.
const REDRAW_HZ: u8 = 4;

/// Where a command's progress goes: a line on the terminal, or nowhere.
#[derive(Debug, Clone, Default)]
pub struct Progress(Option<ProgressBar>);

/// Whether to draw, from what the command writes and what the user asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Show {
    /// The command prints its own lines on standard output (`tail`,
    /// `dead-letters`): draw only when those go elsewhere.
    BesideLines,
    /// The command prints a summary at the end only (`send`).
    Alone,
}

impl Progress {
    /// Draws nothing.
    pub fn hidden() -> Self {
        Progress(None)
    }

    /// A progress line saying `verb` (`sent`, `read`), out of `total` when
    /// it is known, drawn on standard error when someone watches it.
    pub fn start(verb: &'static str, total: Option<u64>, show: Show, quiet: bool) -> Self {
        let stderr = std::io::stderr().is_terminal();
        let lines_on_terminal = show == Show::BesideLines && std::io::stdout().is_terminal();
        if quiet || !stderr || lines_on_terminal {
            return Progress::hidden();
        }
        let target = ProgressDrawTarget::stderr_with_hz(REDRAW_HZ);
        let (bar, template) = match total {
            Some(n) => (
                ProgressBar::with_draw_target(Some(n), target),
                "{prefix} {pos}/{len} ({percent}%) {rate} elapsed {elapsed}",
            ),
            None => (
                ProgressBar::with_draw_target(None, target),
                "{spinner} {prefix} {pos} {rate} elapsed {elapsed}",
            ),
        };
        // The templates are constants: a bad one would be a bug here, and
        // the bar then keeps indicatif's default look.
        if let Ok(style) = ProgressStyle::with_template(template) {
            bar.set_style(style.with_key(
                "rate",
                |state: &indicatif::ProgressState, w: &mut dyn std::fmt::Write| {
                    let _ = write!(w, "{:.0}/s", state.per_sec());
                },
            ));
        }
        bar.set_prefix(verb);
        bar.enable_steady_tick(Duration::from_millis(1000 / u64::from(REDRAW_HZ)));
        Progress(Some(bar))
    }

    /// `n` more done.
    pub fn add(&self, n: u64) {
        if let Some(bar) = &self.0 {
            bar.inc(n);
        }
    }

    /// Ends the line, leaving the final count on the terminal; what the
    /// command prints next starts on a line of its own.
    pub fn finish(&self) {
        if let Some(bar) = &self.0 {
            if !bar.is_finished() {
                bar.finish();
                eprintln!();
            }
        }
    }
}
