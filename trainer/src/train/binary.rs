//! What a binary tells the shared command line about itself, and its arguments parsed from the
//! process: built-in defaults < the binary's preset (its `--demo` settings, or its defaults) <
//! the `--config` file < flags typed on the command line.

use clap::Parser;
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::cli::CommonArgs;
use super::config::parse_command;
use crate::error::Result;

/// A binary's arguments: its own flags with [`CommonArgs`] flattened in.
pub trait Binary: Parser + Serialize + DeserializeOwned {
    /// `--model` when not given, where the binary has a default.
    const DEFAULT_MODEL: Option<&'static str> = None;
    /// The TOML preset of `--demo`: (label for errors, text).
    const DEMO: (&'static str, &'static str);
    /// The TOML preset of a run without `--demo`, where the binary has one.
    const DEFAULTS: Option<(&'static str, &'static str)> = None;

    /// The shared flags.
    fn common(&self) -> &CommonArgs;

    /// The shared flags, to change (`--fit` turns some of them).
    fn common_mut(&mut self) -> &mut CommonArgs;

    /// What `--fit` may turn in the binary's own flags, beside the shared ones (sdxl-ft: where
    /// the EMA lives). None by default.
    fn fit_knobs(&self) -> Vec<super::fit::Knob<Self>> {
        Vec::new()
    }

    /// `--model`, or the binary's default.
    fn model(&self) -> Option<&str> {
        self.common().model.as_deref().or(Self::DEFAULT_MODEL)
    }
}

/// The process's arguments for binary `B`.
pub fn parse_args<B: Binary>() -> Result<B> {
    parse_args_from(std::env::args_os())
}

/// [`parse_args`] over explicit arguments (the first is the program name). `--help` shows
/// `--model`'s default.
pub fn parse_args_from<B, I, A>(args: I) -> Result<B>
where
    B: Binary,
    I: IntoIterator<Item = A>,
    A: Into<std::ffi::OsString> + Clone,
{
    let mut command = B::command();
    if let Some(m) = B::DEFAULT_MODEL {
        command = command.mut_arg("model", |a| a.default_value(m));
    }
    let (mut parsed, given) = parse_command(
        command,
        args,
        |a: &B| a.common().config.clone(),
        |a: &B| {
            if a.common().demo {
                Some(B::DEMO)
            } else {
                B::DEFAULTS
            }
        },
    )?;
    parsed.common_mut().given = given;
    // The ranks of a data-parallel run must train with the same settings.
    let text = serde_json::to_string(&parsed)
        .map_err(|e| crate::error::Error::Invalid(format!("the arguments as JSON: {e}")))?;
    super::ranks::world()?.agree("the configuration (flags and --config)", text.as_bytes())?;
    Ok(parsed)
}
