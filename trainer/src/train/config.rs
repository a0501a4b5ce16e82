//! Command line plus config file, shared by the binaries: `--config FILE` gives defaults, flags
//! typed on the command line override the file, a built-in preset (a binary's defaults, its
//! `--demo`) sits below the file, and built-in defaults fill the rest.
//!
//! A binary declares one struct that derives `clap::Parser`, `Serialize` and `Deserialize` (field
//! names are the TOML keys and the `--long-flags`). [`parse`] merges the three layers and reports a
//! config file's unknown key or wrong type with the file's name.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::Parser;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{Error, Result};

/// Parses the process's arguments; `config_path` picks the `--config` field out of the parsed CLI.
pub fn parse<T>(config_path: impl Fn(&T) -> Option<PathBuf>) -> Result<T>
where
    T: Parser + Serialize + DeserializeOwned,
{
    parse_from(std::env::args_os(), config_path)
}

/// [`parse_from`] with a built-in TOML preset between the flags' defaults and the config file:
/// built-in defaults < preset (a binary's own defaults, or its `--demo` settings) < `--config`
/// file < flags typed on the command line.
pub fn parse_with_preset<T, I, A>(
    args: I,
    config_path: impl Fn(&T) -> Option<PathBuf>,
    preset: impl Fn(&T) -> Option<(&'static str, &'static str)>,
) -> Result<T>
where
    T: Parser + Serialize + DeserializeOwned,
    I: IntoIterator<Item = A>,
    A: Into<std::ffi::OsString> + Clone,
{
    Ok(parse_command(T::command(), args, config_path, preset)?.0)
}

/// [`parse_with_preset`] over `command`: `T`'s own, changed by its binary (a default that the
/// shared flags cannot declare, such as `--model`'s). Also returns the settings the user gave:
/// the flags typed on the command line and the keys of the `--config` file (not the preset's,
/// which are the binary's choices), which `--fit` leaves as they are.
pub fn parse_command<T, I, A>(
    command: clap::Command,
    args: I,
    config_path: impl Fn(&T) -> Option<PathBuf>,
    preset: impl Fn(&T) -> Option<(&'static str, &'static str)>,
) -> Result<(T, BTreeSet<String>)>
where
    T: Parser + Serialize + DeserializeOwned,
    I: IntoIterator<Item = A>,
    A: Into<std::ffi::OsString> + Clone,
{
    let known: Vec<String> = command
        .get_arguments()
        .map(|a| a.get_id().as_str().to_string())
        .collect();
    let matches = command.get_matches_from(args);
    let parsed = T::from_arg_matches(&matches).map_err(|e| Error::Invalid(e.to_string()))?;
    let explicit: Vec<String> = matches
        .ids()
        .filter(|id| matches.value_source(id.as_str()) == Some(ValueSource::CommandLine))
        .map(|id| id.as_str().to_string())
        .collect();
    non_finite_flags(&parsed, &matches, &explicit)?;
    let with_preset = match preset(&parsed) {
        Some((label, text)) => merge_text(&parsed, text, label, &known, &explicit)?,
        None => parsed,
    };
    // Arguments only: clap also reports the group of a flattened struct as typed.
    let mut given: BTreeSet<String> = explicit
        .iter()
        .filter(|id| known.contains(id))
        .cloned()
        .collect();
    let merged = match config_path(&with_preset) {
        Some(path) => {
            let merged = merge_file(&with_preset, &path, &known, &explicit)?;
            // The file parsed in the merge: its keys are the user's settings too.
            let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
            if let Ok(table) = toml::from_str::<toml::Table>(&text) {
                given.extend(table.keys().map(|k| k.replace('-', "_")));
            }
            merged
        }
        None => with_preset,
    };
    Ok((merged, given))
}

/// Refuses a flag typed with a value JSON cannot hold (`--weight-decay NaN`, `--lr inf`): the
/// merge with a preset or file would read it back as null and fail blamed on the file, and an
/// optional number would silently become unset.
fn non_finite_flags<T: Serialize>(
    parsed: &T,
    matches: &clap::ArgMatches,
    explicit: &[String],
) -> Result<()> {
    let Ok(serde_json::Value::Object(values)) = serde_json::to_value(parsed) else {
        return Ok(());
    };
    for id in explicit {
        if !values.get(id).is_some_and(|v| v.is_null()) {
            continue;
        }
        if let Some(raw) = matches.try_get_raw(id).ok().flatten() {
            let raw: Vec<String> = raw.map(|r| r.to_string_lossy().into_owned()).collect();
            return Err(Error::Invalid(format!(
                "--{} {}: must be a finite number",
                id.replace('_', "-"),
                raw.join(" ")
            )));
        }
    }
    Ok(())
}

/// [`parse`] over explicit arguments (the first is the program name). `--help` and bad flags exit
/// through clap as usual.
pub fn parse_from<T, I, A>(args: I, config_path: impl Fn(&T) -> Option<PathBuf>) -> Result<T>
where
    T: Parser + Serialize + DeserializeOwned,
    I: IntoIterator<Item = A>,
    A: Into<std::ffi::OsString> + Clone,
{
    parse_with_preset(args, config_path, |_: &T| None)
}

/// `parsed` (CLI values with built-in defaults) overlaid with the file's values, except those given
/// explicitly on the command line.
pub fn merge_file<T>(parsed: &T, path: &Path, known: &[String], explicit: &[String]) -> Result<T>
where
    T: Serialize + DeserializeOwned,
{
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    merge_text(parsed, &text, &path.display().to_string(), known, explicit)
}

/// [`merge_file`] over TOML text; `label` names it in errors.
pub fn merge_text<T>(
    parsed: &T,
    text: &str,
    label: &str,
    known: &[String],
    explicit: &[String],
) -> Result<T>
where
    T: Serialize + DeserializeOwned,
{
    let cfg_err = |reason: String| Error::Config {
        path: label.to_string(),
        reason,
    };
    let file: toml::Table = toml::from_str(text).map_err(|e| cfg_err(e.to_string()))?;
    // Merged as JSON values, which hold every flag's value (TOML's integers stop at i64::MAX:
    // `--warmup-steps 18446744073709551615` or a 64-bit seed would fail there, blamed on the
    // file).
    let mut merged = match serde_json::to_value(parsed) {
        Ok(serde_json::Value::Object(m)) => m,
        other => {
            return Err(Error::Invalid(format!(
                "the flags could not be merged with {label}: {other:?}"
            )))
        }
    };
    for (key, value) in file {
        let key = key.replace('-', "_");
        if key == "config" || !known.contains(&key) {
            let mut valid: Vec<&str> = known
                .iter()
                .map(|s| s.as_str())
                .filter(|k| *k != "config" && *k != "help" && *k != "version")
                .collect();
            valid.sort();
            return Err(cfg_err(format!(
                "unknown key `{key}` (valid keys: {})",
                valid.join(", ")
            )));
        }
        let value = serde_json::to_value(value).map_err(|e| cfg_err(format!("`{key}`: {e}")))?;
        if !explicit.contains(&key) {
            merged.insert(key, value);
        }
    }
    serde_json::from_value(serde_json::Value::Object(merged)).map_err(|e| cfg_err(e.to_string()))
}
