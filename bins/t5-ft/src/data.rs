//! Seq2seq data: JSONL or CSV records streamed from disk through a byte-offset index, tokenized
//! per batch, padded to the longest sequence of each batch.
//!
//! Only the index (offset and byte length of each record, 12 bytes a record) is held in memory,
//! so a 6M-line file costs ~72 MB rather than its size. Shuffling permutes the index with a seeded
//! generator; "length grouping" sorts mega-batches of 50 batches by byte length (the idea of
//! transformers' `LengthGroupedSampler`) so batches pad little.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// One input/target pair.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub input: String,
    pub target: String,
}

/// Errors of the data layer: each names the file and, where there is one, the line.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: {reason}")]
    Record {
        path: PathBuf,
        line: u64,
        reason: String,
    },
    #[error("{path}: {reason}")]
    File { path: PathBuf, reason: String },
}

type Result<T> = std::result::Result<T, DataError>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Jsonl,
    Csv,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    offset: u64,
    len: u32,
    line: u32,
}

/// Field names and error policy.
#[derive(Debug, Clone)]
pub struct Fields {
    pub input: String,
    pub target: String,
    /// Skip malformed records (counting them) instead of stopping at the first one.
    pub skip_bad: bool,
}

/// A record file indexed by byte offset.
pub struct RecordFile {
    path: PathBuf,
    format: Format,
    fields: Fields,
    /// CSV: column positions of input and target.
    columns: (usize, usize),
    entries: Vec<Entry>,
    skipped: Vec<(u64, String)>,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> DataError + '_ {
    move |e| DataError::Io {
        path: path.to_path_buf(),
        source: e,
    }
}

fn parse_json(text: &str, fields: &Fields) -> std::result::Result<Example, String> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("invalid JSON: {e}"))?;
    let get = |k: &str| -> std::result::Result<String, String> {
        match v.get(k) {
            Some(serde_json::Value::String(s)) => Ok(s.clone()),
            Some(serde_json::Value::Number(n)) => Ok(n.to_string()),
            Some(_) => Err(format!("field `{k}` is not a string")),
            None => Err(format!("no field `{k}`")),
        }
    };
    Ok(Example {
        input: get(&fields.input)?,
        target: get(&fields.target)?,
    })
}

/// A JSONL line as a record: trimmed, and without the byte-order mark some editors write at the
/// start of a UTF-8 file (as the CSV reader ignores it).
fn record_text(line: &str) -> &str {
    line.trim().trim_start_matches('\u{feff}').trim_start()
}

impl RecordFile {
    /// Indexes `path` (`.csv` is CSV with a header row, anything else JSONL), validating every
    /// record once: a malformed one stops here with file:line, or is skipped and counted.
    pub fn open(path: &Path, fields: Fields) -> Result<Self> {
        let format = match path.extension().and_then(|e| e.to_str()) {
            Some("csv") => Format::Csv,
            _ => Format::Jsonl,
        };
        let mut rf = RecordFile {
            path: path.to_path_buf(),
            format,
            fields,
            columns: (0, 0),
            entries: Vec::new(),
            skipped: Vec::new(),
        };
        match format {
            Format::Jsonl => rf.index_jsonl()?,
            Format::Csv => rf.index_csv()?,
        }
        if rf.entries.is_empty() {
            return Err(DataError::File {
                path: path.to_path_buf(),
                reason: if rf.skipped.is_empty() {
                    "no records".into()
                } else {
                    format!("no valid records ({} malformed)", rf.skipped.len())
                },
            });
        }
        Ok(rf)
    }

    fn bad(&mut self, line: u64, reason: String) -> Result<()> {
        if self.fields.skip_bad {
            self.skipped.push((line, reason));
            Ok(())
        } else {
            Err(DataError::Record {
                path: self.path.clone(),
                line,
                reason,
            })
        }
    }

    fn index_jsonl(&mut self) -> Result<()> {
        let file = File::open(&self.path).map_err(io(&self.path))?;
        let mut r = BufReader::new(file);
        let mut offset = 0u64;
        let mut buf = Vec::new();
        let mut line_no = 0u64;
        loop {
            buf.clear();
            // Bytes, not a String: a line that is not UTF-8 is a bad record with its line
            // number, which --skip-bad-lines can skip, not an I/O error of the whole file.
            let n = r.read_until(b'\n', &mut buf).map_err(io(&self.path))?;
            if n == 0 {
                break;
            }
            line_no += 1;
            match std::str::from_utf8(&buf) {
                Err(e) => self.bad(line_no, format!("not valid UTF-8 ({e})"))?,
                Ok(text) => {
                    let text = record_text(text);
                    if !text.is_empty() {
                        match parse_json(text, &self.fields) {
                            Ok(_) => self.entries.push(Entry {
                                offset,
                                len: n as u32,
                                line: line_no as u32,
                            }),
                            Err(reason) => self.bad(line_no, reason)?,
                        }
                    }
                }
            }
            offset += n as u64;
        }
        Ok(())
    }

    fn index_csv(&mut self) -> Result<()> {
        let file = File::open(&self.path).map_err(io(&self.path))?;
        let mut r = csv::ReaderBuilder::new()
            .flexible(true)
            .from_reader(BufReader::new(file));
        let headers = r.headers().map_err(|e| DataError::File {
            path: self.path.clone(),
            reason: format!("CSV header: {e}"),
        })?;
        let col = |name: &str| headers.iter().position(|h| h == name);
        let (Some(i), Some(t)) = (col(&self.fields.input), col(&self.fields.target)) else {
            return Err(DataError::File {
                path: self.path.clone(),
                reason: format!(
                    "CSV header has no `{}` or `{}` column (columns: {})",
                    self.fields.input,
                    self.fields.target,
                    headers.iter().collect::<Vec<_>>().join(", ")
                ),
            });
        };
        self.columns = (i, t);
        let mut rec = csv::StringRecord::new();
        loop {
            let pos = r.position().clone();
            match r.read_record(&mut rec) {
                Ok(false) => break,
                Ok(true) => {
                    let end = r.position().byte();
                    if rec.get(i).is_none() || rec.get(t).is_none() {
                        self.bad(
                            pos.line(),
                            format!("record has {} fields, too few", rec.len()),
                        )?;
                    } else {
                        self.entries.push(Entry {
                            offset: pos.byte(),
                            len: (end - pos.byte()) as u32,
                            line: pos.line() as u32,
                        });
                    }
                }
                Err(e) => {
                    let line = e.position().map(|p| p.line()).unwrap_or(pos.line());
                    self.bad(line, e.to_string())?;
                }
            }
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Malformed records skipped while indexing, as (line, reason).
    pub fn skipped(&self) -> &[(u64, String)] {
        &self.skipped
    }

    /// Byte length of record `i` (a cheap proxy of its token length, for grouping).
    pub fn byte_len(&self, i: usize) -> usize {
        self.entries.get(i).map(|e| e.len as usize).unwrap_or(0)
    }

    /// Reads records `idx` from disk.
    pub fn read(&self, idx: &[usize]) -> Result<Vec<Example>> {
        let mut file = File::open(&self.path).map_err(io(&self.path))?;
        let mut out = Vec::with_capacity(idx.len());
        for &i in idx {
            let e = self
                .entries
                .get(i)
                .copied()
                .ok_or_else(|| DataError::File {
                    path: self.path.clone(),
                    reason: format!("record {i} out of range"),
                })?;
            file.seek(SeekFrom::Start(e.offset))
                .map_err(io(&self.path))?;
            let mut bytes = vec![0u8; e.len as usize];
            file.read_exact(&mut bytes).map_err(io(&self.path))?;
            let rec_err = |reason: String| DataError::Record {
                path: self.path.clone(),
                line: e.line as u64,
                reason,
            };
            let text = String::from_utf8(bytes).map_err(|err| rec_err(err.to_string()))?;
            let ex = match self.format {
                Format::Jsonl => parse_json(record_text(&text), &self.fields).map_err(rec_err)?,
                Format::Csv => {
                    let mut r = csv::ReaderBuilder::new()
                        .has_headers(false)
                        .flexible(true)
                        .from_reader(text.as_bytes());
                    let mut rec = csv::StringRecord::new();
                    r.read_record(&mut rec)
                        .map_err(|err| rec_err(err.to_string()))?;
                    let get = |c: usize| {
                        rec.get(c)
                            .map(str::to_string)
                            .ok_or_else(|| rec_err("missing field".into()))
                    };
                    Example {
                        input: get(self.columns.0)?,
                        target: get(self.columns.1)?,
                    }
                }
            };
            out.push(ex);
        }
        Ok(out)
    }
}
