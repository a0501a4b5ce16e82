//! Few-shot image data: class lists for disjoint train/val/test splits, image decoding and
//! resizing, a synthetic image generator for the demo, and the seeded episodic sampler.

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use ft_models::fewshot::Episode;
use ft_params::rng::SplitMix64;
use rayon::prelude::*;

/// Errors naming the file or class at fault.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: {reason}")]
    File { path: PathBuf, reason: String },
    #[error("{path}:{line}: {reason}")]
    Line {
        path: PathBuf,
        line: u64,
        reason: String,
    },
    #[error("{0}")]
    Invalid(String),
}

type Result<T> = std::result::Result<T, DataError>;

/// Where one image comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum ImageRef {
    File(PathBuf),
    /// The demo's generated images: class seed and sample index.
    Synthetic {
        class_seed: u64,
        index: u64,
    },
}

/// One class and its images.
#[derive(Debug, Clone, PartialEq)]
pub struct Class {
    pub name: String,
    pub images: Vec<ImageRef>,
}

/// The classes of one split.
#[derive(Debug, Clone, Default)]
pub struct Split {
    pub classes: Vec<Class>,
}

/// Train, validation and test splits with disjoint classes.
#[derive(Debug, Clone, Default)]
pub struct Splits {
    pub train: Split,
    /// Empty when the run does not validate (`--val-episodes 0`).
    pub val: Split,
    pub test: Split,
    /// How the splits were made when the data did not say (classes split by seed, validation
    /// classes carved from the training ones): the run prints it.
    pub note: Option<String>,
}

/// What the splits must serve: episodes of `n_way` classes, and validation or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitPlan {
    pub n_way: usize,
    pub validate: bool,
}

const IMAGE_EXT: [&str; 4] = ["jpg", "jpeg", "png", "JPEG"];

fn list_dir(dir: &Path) -> Result<Vec<PathBuf>> {
    let rd = std::fs::read_dir(dir).map_err(|e| DataError::File {
        path: dir.to_path_buf(),
        reason: e.to_string(),
    })?;
    let mut v: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
    v.sort();
    Ok(v)
}

fn classes_in(dir: &Path) -> Result<Vec<Class>> {
    let mut classes = Vec::new();
    for sub in list_dir(dir)?.into_iter().filter(|p| p.is_dir()) {
        let images: Vec<ImageRef> = list_dir(&sub)?
            .into_iter()
            .filter(|p| {
                p.extension()
                    .and_then(|e| e.to_str())
                    .is_some_and(|e| IMAGE_EXT.contains(&e))
            })
            .map(ImageRef::File)
            .collect();
        if !images.is_empty() {
            let name = sub
                .file_name()
                .map(|n| n.to_string_lossy().to_string())
                .unwrap_or_default();
            classes.push(Class { name, images });
        }
    }
    Ok(classes)
}

/// miniImageNet's `{split}.csv` (`filename,label`) with images in `images/`.
fn classes_from_csv(csv_path: &Path, images: &Path) -> Result<Vec<Class>> {
    let mut r = csv::Reader::from_path(csv_path).map_err(|e| DataError::File {
        path: csv_path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let mut classes: Vec<Class> = Vec::new();
    for (i, rec) in r.records().enumerate() {
        let line = i as u64 + 2;
        let rec = rec.map_err(|e| DataError::Line {
            path: csv_path.to_path_buf(),
            line,
            reason: e.to_string(),
        })?;
        let (Some(file), Some(label)) = (rec.get(0), rec.get(1)) else {
            return Err(DataError::Line {
                path: csv_path.to_path_buf(),
                line,
                reason: "expected filename,label".into(),
            });
        };
        let img = ImageRef::File(images.join(file));
        match classes.iter_mut().find(|c| c.name == label) {
            Some(c) => c.images.push(img),
            None => classes.push(Class {
                name: label.to_string(),
                images: vec![img],
            }),
        }
    }
    Ok(classes)
}

impl Splits {
    /// Reads a dataset folder for `plan`: miniImageNet layout (`train.csv`, `val.csv`, `test.csv`,
    /// `images/`), or `train/`, `val/`, `test/` folders of class folders, or one folder of class
    /// folders split by seed into 64% / 16% / 20% of the classes.
    pub fn from_dir(dir: &Path, seed: u64, plan: SplitPlan) -> Result<Self> {
        if dir.join("train.csv").is_file() {
            let img = dir.join("images");
            let val = dir.join("val.csv");
            let val = val
                .is_file()
                .then(|| classes_from_csv(&val, &img))
                .transpose()?;
            return Self::given(
                classes_from_csv(&dir.join("train.csv"), &img)?,
                val,
                classes_from_csv(&dir.join("test.csv"), &img)?,
                seed,
                plan,
                "val.csv",
            );
        }
        if dir.join("train").is_dir() {
            let val = dir.join("val");
            let val = val.is_dir().then(|| classes_in(&val)).transpose()?;
            return Self::given(
                classes_in(&dir.join("train"))?,
                val,
                classes_in(&dir.join("test"))?,
                seed,
                plan,
                "val/",
            );
        }
        let mut all = classes_in(dir)?;
        let n = all.len();
        let w = plan.n_way;
        // The paper's 64% / 16% / 20% of the classes, each split at least one episode wide.
        let n_test = (n * 20 / 100).max(w).max(1);
        let n_val = if plan.validate {
            (n * 16 / 100).max(w).max(1)
        } else {
            0
        };
        if n < n_test + n_val + w.max(1) {
            return Err(DataError::File {
                path: dir.to_path_buf(),
                reason: format!(
                    "{n} class folders cannot make disjoint {w}-way train{} and test splits \
                     (they need {} classes): use a smaller --n-way{}, or a train/ val/ test/ \
                     layout",
                    if plan.validate { ", validation" } else { "" },
                    n_test + n_val + w.max(1),
                    if plan.validate {
                        ", --val-episodes 0 (no validation: the last checkpoint is tested)"
                    } else {
                        ""
                    }
                ),
            });
        }
        SplitMix64::new(seed).shuffle(&mut all);
        let test = all.split_off(n - n_test);
        let val = all.split_off(n - n_test - n_val);
        let note = format!(
            "{}: {n} classes split by --seed into {} train, {} validation and {} test classes",
            dir.display(),
            all.len(),
            val.len(),
            test.len()
        );
        Ok(Splits {
            train: Split { classes: all },
            val: Split { classes: val },
            test: Split { classes: test },
            note: Some(note),
        })
    }

    /// Splits a dataset gives as train, (maybe) validation and test: without validation classes
    /// (`missing` names what was looked for) and with validation asked, some are carved from the
    /// training classes by seed, at least one episode's worth, and said so.
    fn given(
        mut train: Vec<Class>,
        val: Option<Vec<Class>>,
        test: Vec<Class>,
        seed: u64,
        plan: SplitPlan,
        missing: &str,
    ) -> Result<Self> {
        let (val, note) = match (val, plan.validate) {
            (_, false) => (Vec::new(), None),
            (Some(v), true) => (v, None),
            (None, true) => {
                let n = train.len();
                let carve = (n / 5).max(plan.n_way).max(1);
                if n < carve + plan.n_way.max(1) {
                    return Err(DataError::Invalid(format!(
                        "no {missing}, and the {n} training classes cannot give {carve} for \
                         validation and keep {} to train: add {missing}, or pass \
                         --val-episodes 0 (no validation: the last checkpoint is tested)",
                        plan.n_way
                    )));
                }
                SplitMix64::new(seed).shuffle(&mut train);
                let val = train.split_off(n - carve);
                let note = format!(
                    "no {missing}: {carve} of the {n} training classes (chosen by --seed) \
                     validate instead: {}",
                    val.iter()
                        .map(|c| c.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                (val, Some(note))
            }
        };
        Ok(Splits {
            train: Split { classes: train },
            val: Split { classes: val },
            test: Split { classes: test },
            note,
        })
    }

    /// The demo's synthetic dataset: `n_classes` classes of `per_class` images, split 50/20/30.
    pub fn synthetic(n_classes: usize, per_class: usize, seed: u64) -> Self {
        let mk = |c: usize| Class {
            name: format!("synthetic-{c:03}"),
            images: (0..per_class as u64)
                .map(|index| ImageRef::Synthetic {
                    class_seed: seed ^ ((c as u64 + 1) * 0x9E37_79B9),
                    index,
                })
                .collect(),
        };
        let n_train = n_classes / 2;
        let n_val = n_classes / 5;
        Splits {
            train: Split {
                classes: (0..n_train).map(mk).collect(),
            },
            val: Split {
                classes: (n_train..n_train + n_val).map(mk).collect(),
            },
            test: Split {
                classes: (n_train + n_val..n_classes).map(mk).collect(),
            },
            note: None,
        }
    }

    /// Checks that every split (validation, where there is one) can make `n_way`-way episodes
    /// of `per_class` images per class.
    pub fn check(&self, n_way: usize, per_class: usize) -> Result<()> {
        for (name, s) in [
            ("train", &self.train),
            ("val", &self.val),
            ("test", &self.test),
        ] {
            if name == "val" && s.classes.is_empty() {
                continue; // no validation
            }
            if s.classes.len() < n_way {
                return Err(DataError::Invalid(format!(
                    "the {name} split has {} classes; {n_way}-way episodes need {n_way}",
                    s.classes.len()
                )));
            }
            if let Some(c) = s.classes.iter().find(|c| c.images.len() < per_class) {
                return Err(DataError::Invalid(format!("class `{}` ({name}) has {} images; an episode needs {per_class} (k_shot + n_query)", c.name, c.images.len())));
            }
        }
        let names = |s: &Split| {
            s.classes
                .iter()
                .map(|c| c.name.clone())
                .collect::<std::collections::HashSet<_>>()
        };
        if !names(&self.train).is_disjoint(&names(&self.test))
            || !names(&self.train).is_disjoint(&names(&self.val))
        {
            return Err(DataError::Invalid(
                "train, val and test classes must be disjoint".into(),
            ));
        }
        Ok(())
    }
}

/// How images become tensors.
#[derive(Debug, Clone, Copy)]
pub struct ImageConfig {
    pub size: usize,
    /// Random crop and horizontal flip (training only).
    pub augment: bool,
}

const MEAN: [f32; 3] = [0.485, 0.456, 0.406];
const STD: [f32; 3] = [0.229, 0.224, 0.225];

/// Generates one synthetic image. A class is a geometry: the orientation and frequency of a
/// grating and the place of a bright blob. Colours are drawn per image, so they carry no class
/// information (a model that compares raw colours, or random features, does poorly), and each
/// image also gets a random phase, a jittered blob and pixel noise.
fn synthetic(class_seed: u64, index: u64, size: usize) -> Vec<f32> {
    let mut c = SplitMix64::new(class_seed);
    let theta = c.uniform() * std::f64::consts::PI;
    let freq = 1.5 + c.uniform() * 3.0;
    let (bx, by) = (0.2 + 0.6 * c.uniform(), 0.2 + 0.6 * c.uniform());
    let base1: Vec<f64> = (0..3).map(|_| c.uniform()).collect();
    let base2: Vec<f64> = (0..3).map(|_| c.uniform()).collect();
    let mut s =
        SplitMix64::new(class_seed ^ index.wrapping_mul(0xD134_2543_DE82_EF95).wrapping_add(7));
    let col1: Vec<f64> = base1
        .iter()
        .map(|b| b + 0.5 * (s.uniform() - 0.5))
        .collect();
    let col2: Vec<f64> = base2
        .iter()
        .map(|b| b + 0.5 * (s.uniform() - 0.5))
        .collect();
    let phase = s.uniform() * std::f64::consts::TAU;
    let (jx, jy) = ((s.uniform() - 0.5) * 0.15, (s.uniform() - 0.5) * 0.15);
    let mut img = vec![0f32; 3 * size * size];
    for y in 0..size {
        for x in 0..size {
            let (u, v) = (x as f64 / size as f64, y as f64 / size as f64);
            let g = 0.5
                + 0.5
                    * (std::f64::consts::TAU * freq * (u * theta.cos() + v * theta.sin()) + phase)
                        .sin();
            let blob = (-((u - bx - jx).powi(2) + (v - by - jy).powi(2)) / 0.01).exp();
            for ch in 0..3 {
                let val =
                    col1[ch] * g + col2[ch] * (1.0 - g) + 0.6 * blob + 0.2 * (s.uniform() - 0.5);
                img[ch * size * size + y * size + x] =
                    ((val.clamp(0.0, 1.0) as f32) - MEAN[ch]) / STD[ch];
            }
        }
    }
    img
}

fn decode(path: &Path, cfg: ImageConfig, rng: &mut SplitMix64) -> Result<Vec<f32>> {
    let img = image::open(path).map_err(|e| DataError::File {
        path: path.to_path_buf(),
        reason: format!("cannot read image: {e}"),
    })?;
    let rgb = img.to_rgb8();
    // Resize the shorter side to 1.15 x size, then crop size x size (centre, or random when
    // augmenting), as the CloserLook/FSCT transforms do.
    let s = cfg.size as f64 * 1.15;
    let (w, h) = (rgb.width() as f64, rgb.height() as f64);
    let scale = s / w.min(h);
    let (nw, nh) = (
        ((w * scale).round() as u32).max(cfg.size as u32),
        ((h * scale).round() as u32).max(cfg.size as u32),
    );
    let resized = image::imageops::resize(&rgb, nw, nh, image::imageops::FilterType::Triangle);
    let (max_x, max_y) = (nw - cfg.size as u32, nh - cfg.size as u32);
    let (ox, oy) = if cfg.augment {
        (
            rng.below(max_x as usize + 1) as u32,
            rng.below(max_y as usize + 1) as u32,
        )
    } else {
        (max_x / 2, max_y / 2)
    };
    let flip = cfg.augment && rng.uniform() < 0.5;
    let n = cfg.size;
    let mut out = vec![0f32; 3 * n * n];
    for y in 0..n {
        for x in 0..n {
            let sx = if flip { n - 1 - x } else { x };
            let p = resized.get_pixel(ox + sx as u32, oy + y as u32);
            for ch in 0..3 {
                out[ch * n * n + y * n + x] = (p[ch] as f32 / 255.0 - MEAN[ch]) / STD[ch];
            }
        }
    }
    Ok(out)
}

/// Loads `refs` into a [N, 3, S, S] tensor (decoding in parallel).
pub fn load_images(
    refs: &[ImageRef],
    cfg: ImageConfig,
    seed: u64,
    device: &Device,
) -> Result<Tensor> {
    let imgs: Vec<Vec<f32>> = refs
        .par_iter()
        .enumerate()
        .map(|(i, r)| {
            let mut rng = SplitMix64::new(seed ^ (i as u64).wrapping_mul(0x2545_F491_4F6C_DD1D));
            match r {
                ImageRef::File(p) => decode(p, cfg, &mut rng),
                ImageRef::Synthetic { class_seed, index } => {
                    Ok(synthetic(*class_seed, *index, cfg.size))
                }
            }
        })
        .collect::<Result<_>>()?;
    let n = imgs.len();
    Tensor::from_vec(imgs.concat(), (n, 3, cfg.size, cfg.size), device)
        .map_err(|e| DataError::Invalid(e.to_string()))
}

/// Episode shape.
#[derive(Debug, Clone, Copy)]
pub struct EpisodeShape {
    pub n_way: usize,
    pub k_shot: usize,
    pub n_query: usize,
}

/// Draws episode number `index` from `split`: a function of (seed, index) only, so a run's
/// episodes are reproducible and a resumed run draws the same ones.
pub fn sample_episode(
    split: &Split,
    shape: EpisodeShape,
    seed: u64,
    index: u64,
    img: ImageConfig,
    device: &Device,
) -> Result<Episode> {
    let mut rng = SplitMix64::new(seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xE915);
    let mut classes: Vec<usize> = (0..split.classes.len()).collect();
    rng.shuffle(&mut classes);
    let per = shape.k_shot + shape.n_query;
    let mut refs = Vec::with_capacity(shape.n_way * per);
    for &c in classes.iter().take(shape.n_way) {
        let class = &split.classes[c];
        let mut idx: Vec<usize> = (0..class.images.len()).collect();
        rng.shuffle(&mut idx);
        refs.extend(idx.iter().take(per).map(|&i| class.images[i].clone()));
    }
    let images = load_images(&refs, img, rng.next_u64(), device)?;
    Ok(Episode {
        images,
        n_way: shape.n_way,
        k_shot: shape.k_shot,
        n_query: shape.n_query,
    })
}
