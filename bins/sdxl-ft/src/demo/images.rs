//! The demo's captioned images: one coloured shape on a plain background, drawn here so the demo
//! needs no download. [`write_images`] writes the training set; [`random_batch`] draws fresh
//! scenes at the training resolution for fitting the demo's VAE.

use std::path::Path;

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use ft_params::rng::SplitMix64;
use serde_json::json;

pub(super) const COLORS: [(&str, [u8; 3]); 4] = [
    ("red", [220, 40, 40]),
    ("green", [40, 180, 60]),
    ("blue", [40, 70, 220]),
    ("yellow", [230, 210, 40]),
];
pub(super) const SHAPES: [&str; 3] = ["circle", "square", "triangle"];
pub(super) const BACKGROUNDS: [(&str, [u8; 3]); 2] =
    [("white", [245, 245, 245]), ("black", [15, 15, 15])];

/// One image's content: a shape of radius `r` centred at (`cx`, `cy`) in pixels.
struct Scene {
    shape: &'static str,
    color: [u8; 3],
    bg: [u8; 3],
    cx: f64,
    cy: f64,
    r: f64,
}

impl Scene {
    fn inside(&self, x: f64, y: f64) -> bool {
        let (dx, dy, r) = (x - self.cx, y - self.cy, self.r);
        match self.shape {
            "circle" => dx * dx + dy * dy <= r * r,
            "square" => dx.abs() <= r * 0.85 && dy.abs() <= r * 0.85,
            _ => dy >= -r && dy <= r * 0.8 && dx.abs() <= (dy + r) * 0.6,
        }
    }

    /// The scene as a `w` x `h` image, each pixel the mean of `ss` x `ss` samples (1: one sample
    /// at the pixel's centre, hard edges; more: the soft edges a resized image has).
    fn render(&self, w: u32, h: u32, ss: u32) -> image::RgbImage {
        image::RgbImage::from_fn(w, h, |x, y| {
            let mut sum = [0u32; 3];
            for sy in 0..ss {
                for sx in 0..ss {
                    let px = x as f64 + (sx as f64 + 0.5) / ss as f64;
                    let py = y as f64 + (sy as f64 + 0.5) / ss as f64;
                    let c = if self.inside(px, py) {
                        self.color
                    } else {
                        self.bg
                    };
                    for k in 0..3 {
                        sum[k] += c[k] as u32;
                    }
                }
            }
            let n = ss * ss;
            image::Rgb(sum.map(|s| ((s + n / 2) / n) as u8))
        })
    }
}

/// Writes `n` captioned shape images (sizes vary, so resize and crop are exercised) with a
/// metadata.jsonl into `dir`.
pub fn write_images(dir: &Path, n: usize, seed: u64) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut rng = SplitMix64::new(seed ^ 0x1A6E);
    let mut meta = String::new();
    for i in 0..n {
        let (cname, color) = COLORS[i % COLORS.len()];
        let shape = SHAPES[(i / COLORS.len()) % SHAPES.len()];
        let (bname, bg) = BACKGROUNDS[(i / (COLORS.len() * SHAPES.len())) % BACKGROUNDS.len()];
        let (w, h) = (48 + 8 * rng.below(3), 48 + 8 * rng.below(3));
        let scene = Scene {
            shape,
            color,
            bg,
            cx: w as f64 / 2.0,
            cy: h as f64 / 2.0,
            r: 12.0 + rng.uniform() * 6.0,
        };
        let img = scene.render(w as u32, h as u32, 1);
        let file = format!("{i:03}.png");
        img.save(dir.join(&file))
            .with_context(|| dir.join(&file).display().to_string())?;
        meta.push_str(
            &json!({"file_name": file, "text": format!("a {cname} {shape} on a {bname} background")})
                .to_string(),
        );
        meta.push('\n');
    }
    std::fs::write(dir.join("metadata.jsonl"), meta)?;
    Ok(())
}

/// `n` random scenes at `size` x `size` as a [n, 3, size, size] f32 tensor in [-1, 1] (the
/// training pipeline's range): every colour, shape and background, the shape's size and place
/// around those of the written images after their resize to `size` (radius 20-40% of the side,
/// centre within a tenth of the middle), with soft edges.
pub fn random_batch(rng: &mut SplitMix64, n: usize, size: usize) -> Result<Tensor> {
    let s = size as f64;
    let mut v = Vec::with_capacity(n * 3 * size * size);
    for _ in 0..n {
        let scene = Scene {
            shape: SHAPES[rng.below(SHAPES.len())],
            color: COLORS[rng.below(COLORS.len())].1,
            bg: BACKGROUNDS[rng.below(BACKGROUNDS.len())].1,
            cx: s * (0.4 + 0.2 * rng.uniform()),
            cy: s * (0.4 + 0.2 * rng.uniform()),
            r: s * (0.2 + 0.2 * rng.uniform()),
        };
        let img = scene.render(size as u32, size as u32, 4);
        for c in 0..3 {
            v.extend(img.pixels().map(|p| p.0[c] as f32 / 127.5 - 1.0));
        }
    }
    Ok(Tensor::from_vec(v, (n, 3, size, size), &Device::Cpu)?)
}
