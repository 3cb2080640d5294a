//! What long operations report as they go: downloading the default model
//! and loading weights. A caller draws bars or prints lines from it; the
//! library itself prints nothing.

/// One report. A step is a `Begin`, any number of `Advance`s, then `End`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress<'a> {
    /// A step begins: what it does, and how many bytes it will take where
    /// that is known.
    Begin {
        /// What the step does ("loading path/to/model", "downloading URL").
        what: &'a str,
        /// Bytes the step will process; `None` where that is unknown (a
        /// download without a length).
        total_bytes: Option<u64>,
    },
    /// `bytes` more of the current step are done.
    Advance {
        /// Bytes done since the last report (not a running total).
        bytes: u64,
    },
    /// The current step is done.
    End,
}
