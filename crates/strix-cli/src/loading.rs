//! Loading a model with a progress bar on stderr: what every command that loads one shares,
//! `--quant`'s loader included (so it sits below both `common` and `quant_flag`).

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use strix::backend::Backend;
use strix::model::{Model, ModelFiles};

/// A progress bar on stderr counting `unit`s ("bytes" shows sizes); indicatif draws nothing
/// when stderr is not a terminal.
pub fn progress_bar(message: &'static str, unit: &str) -> ProgressBar {
    let counts =
        if unit == "bytes" { "{bytes}/{total_bytes}".to_string() } else { format!("{{pos}}/{{len}} {unit}") };
    let template = format!("{{msg}} [{{bar:40}}] {counts} ({{elapsed}})");
    let style = ProgressStyle::with_template(&template).unwrap_or_else(|_| ProgressStyle::default_bar());
    ProgressBar::new(0).with_style(style.progress_chars("=> ")).with_message(message)
}

/// Runs `f` with a progress callback drawing a bar, cleared when `f` returns.
pub fn with_progress<T>(message: &'static str, unit: &str, f: impl FnOnce(&dyn Fn(u64, u64)) -> T) -> T {
    let bar = progress_bar(message, unit);
    let progress = |done: u64, total: u64| {
        bar.set_length(total);
        bar.set_position(done);
    };
    let out = f(&progress);
    bar.finish_and_clear();
    out
}

/// Loads a model directory's weights (or a GGUF file's) onto `backend`, with a progress bar
/// over the read of the files (a directory's load reports bytes read; a GGUF load, layers).
pub fn load_model<B: Backend>(files: ModelFiles, backend: B) -> Result<Model<B>> {
    let unit = if files.gguf().is_some() { "layers" } else { "bytes" };
    Ok(with_progress("loading", unit, |p| Model::load_files(files, backend, Some(p)))?)
}
