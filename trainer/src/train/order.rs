//! The order of a run's data, one epoch at a time: a seeded shuffle, micro-batches cut from it
//! (grouped by length, or one aspect bucket each), and where the run is in it, which a checkpoint
//! saves and a resume restores. The one place every trainer's data order comes from, and the
//! seam where a data-parallel run will give each rank its share.

use std::collections::BTreeMap;

use ft_params::rng::SplitMix64;

use super::task::TaskResult;

/// How an epoch's items are cut into micro-batches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grouping {
    /// In the (shuffled) order.
    None,
    /// Items of similar length together, less padding (HF Trainer's `group_by_length`): within
    /// each window of 50 micro-batches the items are sorted longest first; with a shuffle the
    /// micro-batches are shuffled again. One length per item.
    ByLength(Vec<usize>),
    /// Every micro-batch holds items of one key only (an aspect bucket's latent shape, kohya's
    /// bucketing), keys in ascending order; with a shuffle and several keys, the micro-batches
    /// are shuffled again. One key per item.
    Buckets(Vec<Vec<usize>>),
}

/// The micro-batches of every epoch of `items` items: a function of the seed and the epoch
/// only, so a resumed run sees the order an uninterrupted one would.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpochOrder {
    pub items: usize,
    pub batch_size: usize,
    pub seed: u64,
    pub shuffle: bool,
    pub grouping: Grouping,
}

impl EpochOrder {
    /// Epoch `epoch`'s micro-batches, as item indices.
    pub fn batches(&self, epoch: usize) -> Vec<Vec<usize>> {
        let bs = self.batch_size.max(1);
        let mut rng = SplitMix64::new(self.seed ^ (epoch as u64).wrapping_mul(EPOCH_MIX));
        let mut order: Vec<usize> = (0..self.items).collect();
        if self.shuffle {
            rng.shuffle(&mut order);
        }
        let chunks =
            |o: &[usize]| -> Vec<Vec<usize>> { o.chunks(bs).map(|c| c.to_vec()).collect() };
        let (mut batches, reshuffle) = match &self.grouping {
            Grouping::None => (chunks(&order), false),
            Grouping::ByLength(len) => {
                for window in order.chunks_mut(bs * 50) {
                    window.sort_by_key(|&i| std::cmp::Reverse(len.get(i).copied().unwrap_or(0)));
                }
                (chunks(&order), true)
            }
            Grouping::Buckets(keys) => {
                let mut groups: BTreeMap<&[usize], Vec<usize>> = BTreeMap::new();
                for i in order {
                    let key = keys.get(i).map(|k| k.as_slice()).unwrap_or(&[]);
                    groups.entry(key).or_default().push(i);
                }
                let several = groups.len() > 1;
                (groups.values().flat_map(|g| chunks(g)).collect(), several)
            }
        };
        if self.shuffle && reshuffle {
            rng.shuffle(&mut batches);
        }
        batches
    }

    /// Micro-batches in one epoch.
    pub fn batches_per_epoch(&self) -> usize {
        self.batches(0).len()
    }
}

/// Mixes the epoch into the order's seed.
const EPOCH_MIX: u64 = 0x9E37_79B9_7F4A_7C15;

/// Where a task is in its data: the epoch, its items in order, and the next one's index. What
/// a checkpoint's `trainer_state.json` keeps as `data` (`{"epoch", "cursor"}`): the items are
/// planned again from the epoch on resume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Epochs<I> {
    epoch: usize,
    cursor: usize,
    items: Vec<I>,
}

impl<I: Clone> Default for Epochs<I> {
    fn default() -> Self {
        Epochs {
            epoch: 0,
            cursor: 0,
            items: Vec::new(),
        }
    }
}

impl<I: Clone> Epochs<I> {
    /// Starts epoch `epoch` over `items`, from the first.
    pub fn start(&mut self, epoch: usize, items: Vec<I>) {
        self.epoch = epoch;
        self.cursor = 0;
        self.items = items;
    }

    /// The next item of the epoch, `None` at its end.
    pub fn next_item(&mut self) -> Option<I> {
        let item = self.items.get(self.cursor).cloned()?;
        self.cursor += 1;
        Some(item)
    }

    /// The current epoch.
    pub fn epoch(&self) -> usize {
        self.epoch
    }

    /// The position as a checkpoint keeps it.
    pub fn cursor(&self) -> EpochCursor {
        EpochCursor {
            epoch: self.epoch,
            cursor: self.cursor,
        }
    }

    /// Returns to a saved position: the epoch's items planned again by `plan`, then the cursor.
    pub fn restore(
        &mut self,
        state: &serde_json::Value,
        plan: impl FnOnce(usize) -> Vec<I>,
    ) -> TaskResult<()> {
        let at = EpochCursor::from_json(state)?;
        self.start(at.epoch, plan(at.epoch));
        self.cursor = at.cursor;
        Ok(())
    }
}

/// Where an epoch-based task is in its data: the epoch and the next item's index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EpochCursor {
    pub epoch: usize,
    pub cursor: usize,
}

impl EpochCursor {
    pub fn to_json(self) -> serde_json::Value {
        serde_json::json!({"epoch": self.epoch, "cursor": self.cursor})
    }

    /// Reads what [`EpochCursor::to_json`] wrote; names the missing field.
    pub fn from_json(v: &serde_json::Value) -> TaskResult<Self> {
        let field = |k: &str| -> TaskResult<usize> {
            Ok(v[k]
                .as_u64()
                .ok_or_else(|| format!("trainer_state: data.{k} missing"))? as usize)
        };
        Ok(EpochCursor {
            epoch: field("epoch")?,
            cursor: field("cursor")?,
        })
    }
}
