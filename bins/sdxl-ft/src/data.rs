//! Captioned images in a folder, the way diffusers' `imagefolder` (metadata.jsonl with
//! `file_name` and a caption column) and kohya (a `.txt` caption beside each image) lay them out,
//! and the preprocessing of diffusers' SDXL script: resized (bilinear) so the target just fits
//! (the `res` square, or the nearest aspect-ratio bucket of about `res^2` pixels), center or
//! random crop, optional flip, pixels in [-1, 1], and the original size and crop corner SDXL is
//! conditioned on.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use candle_core::{Device, Tensor};
use ft_params::rng::SplitMix64;

const IMAGE_EXTENSIONS: [&str; 3] = ["png", "jpg", "jpeg"];

/// One image and its caption.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageRecord {
    pub path: PathBuf,
    pub caption: String,
}

/// The images of a folder with their captions, in a fixed order.
#[derive(Debug, Clone)]
pub struct ImageFolder {
    pub dir: PathBuf,
    pub records: Vec<ImageRecord>,
}

fn is_image(p: &Path) -> bool {
    p.extension()
        .and_then(|e| e.to_str())
        .map(|e| IMAGE_EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()))
        .unwrap_or(false)
}

impl ImageFolder {
    /// Reads `dir/metadata.jsonl` when present (each line a JSON object with `file_name` and
    /// `caption_column`), else pairs every image with its `.txt` caption. Errors name the file
    /// and line.
    pub fn scan(dir: &Path, caption_column: &str) -> Result<Self> {
        if !dir.is_dir() {
            return Err(anyhow!("{}: not a folder", dir.display()));
        }
        let meta = dir.join("metadata.jsonl");
        let records = if meta.is_file() {
            Self::from_metadata(dir, &meta, caption_column)?
        } else {
            Self::from_sidecars(dir)?
        };
        if records.is_empty() {
            return Err(anyhow!(
                "{}: no images (png, jpg) with captions",
                dir.display()
            ));
        }
        Ok(ImageFolder {
            dir: dir.to_path_buf(),
            records,
        })
    }

    fn from_metadata(dir: &Path, meta: &Path, column: &str) -> Result<Vec<ImageRecord>> {
        let file = std::fs::File::open(meta).with_context(|| meta.display().to_string())?;
        let mut out = Vec::new();
        for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
            let at = || format!("{}:{}", meta.display(), i + 1);
            let line = line.with_context(at)?;
            if line.trim().is_empty() {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(&line)
                .map_err(|e| anyhow!("{}: not a JSON object: {e}", at()))?;
            let name = v
                .get("file_name")
                .and_then(|f| f.as_str())
                .ok_or_else(|| anyhow!("{}: no string `file_name`", at()))?;
            let caption = v
                .get(column)
                .and_then(|c| c.as_str())
                .ok_or_else(|| anyhow!("{}: no string `{column}` (the caption column)", at()))?;
            let path = dir.join(name);
            if !path.is_file() {
                return Err(anyhow!(
                    "{}: `{name}` does not exist in {}",
                    at(),
                    dir.display()
                ));
            }
            out.push(ImageRecord {
                path,
                caption: caption.to_string(),
            });
        }
        Ok(out)
    }

    fn from_sidecars(dir: &Path) -> Result<Vec<ImageRecord>> {
        let mut images: Vec<PathBuf> = std::fs::read_dir(dir)
            .with_context(|| dir.display().to_string())?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && is_image(p))
            .collect();
        images.sort();
        images
            .into_iter()
            .map(|path| {
                let txt = path.with_extension("txt");
                let caption = std::fs::read_to_string(&txt).map_err(|_| {
                    anyhow!(
                        "{}: no caption (expected {} or a metadata.jsonl in {})",
                        path.display(),
                        txt.display(),
                        dir.display()
                    )
                })?;
                Ok(ImageRecord {
                    path,
                    caption: caption.trim().to_string(),
                })
            })
            .collect()
    }
}

/// How the training square is cut out of the resized image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Crop {
    Center,
    Random,
    /// At (top, left) of the resized image: where the cache cut an image before.
    At(usize, usize),
}

/// An image ready for the VAE with SDXL's micro-conditioning values.
pub struct Prepared {
    /// [3, height, width], values in [-1, 1].
    pub pixels: Tensor,
    /// (height, width) of the file.
    pub original: (usize, usize),
    /// (top, left) of the crop in the resized image.
    pub crop: (usize, usize),
}

/// (height, width) of an image file without decoding its pixels.
pub fn image_size(path: &Path) -> Result<(usize, usize)> {
    let (w, h) = image::ImageReader::open(path)
        .with_context(|| path.display().to_string())?
        .with_guessed_format()
        .with_context(|| path.display().to_string())?
        .into_dimensions()
        .map_err(|e| anyhow!("{}: unreadable image: {e}", path.display()))?;
    Ok((h as usize, w as usize))
}

/// Aspect-ratio buckets of about `res * res` pixels (kohya's bucketing): for each width from
/// `res / 2` to `2 res` in steps of `step`, the tallest height (a multiple of `step`) whose area
/// stays within `res^2`. The square `res x res` is always one of them. (height, width) pairs.
pub fn buckets(res: usize, step: usize) -> Vec<(usize, usize)> {
    let step = step.max(1);
    let mut out = vec![(res, res)];
    let mut w = (res / 2).div_ceil(step) * step;
    while w <= 2 * res {
        let h = (res * res / w) / step * step;
        if h >= step && h >= res / 2 && h <= 2 * res && !out.contains(&(h, w)) {
            out.push((h, w));
        }
        w += step;
    }
    out.sort();
    out
}

/// The bucket whose aspect ratio is closest to an image of `size` (height, width).
pub fn nearest_bucket(size: (usize, usize), buckets: &[(usize, usize)]) -> (usize, usize) {
    let ratio = |h: usize, w: usize| (w as f64 / h.max(1) as f64).ln();
    let r = ratio(size.0, size.1);
    buckets
        .iter()
        .copied()
        .min_by(|a, b| {
            let da = (ratio(a.0, a.1) - r).abs();
            let db = (ratio(b.0, b.1) - r).abs();
            da.total_cmp(&db)
        })
        .unwrap_or(size)
}

/// Loads `path` and cuts a `target` (height, width) region (flipped when `flip`), as diffusers'
/// SDXL script does for squares: resized (bilinear) so the target just fits, then cropped; for a
/// flipped image the crop's left coordinate becomes `width - left`, as there.
pub fn prepare(
    path: &Path,
    target: (usize, usize),
    crop: Crop,
    flip: bool,
    rng: &mut SplitMix64,
) -> Result<Prepared> {
    let img = image::ImageReader::open(path)
        .with_context(|| path.display().to_string())?
        .with_guessed_format()
        .with_context(|| path.display().to_string())?
        .decode()
        .map_err(|e| anyhow!("{}: unreadable image: {e}", path.display()))?
        .to_rgb8();
    let (w, h) = (img.width() as usize, img.height() as usize);
    if w == 0 || h == 0 {
        return Err(anyhow!("{}: empty image", path.display()));
    }
    let (th, tw) = target;
    let scale = (th as f64 / h as f64).max(tw as f64 / w as f64);
    let (nw, nh) = (
        ((w as f64 * scale).round() as usize).max(tw),
        ((h as f64 * scale).round() as usize).max(th),
    );
    let resized = image::imageops::resize(
        &img,
        nw as u32,
        nh as u32,
        image::imageops::FilterType::Triangle,
    );
    let (top, left) = match crop {
        Crop::Center => (
            ((nh - th) as f64 / 2.0).round() as usize,
            ((nw - tw) as f64 / 2.0).round() as usize,
        ),
        Crop::Random => (rng.below(nh - th + 1), rng.below(nw - tw + 1)),
        Crop::At(top, left) => (top.min(nh - th), left.min(nw - tw)),
    };
    let mut cut =
        image::imageops::crop_imm(&resized, left as u32, top as u32, tw as u32, th as u32)
            .to_image();
    let left = if flip {
        image::imageops::flip_horizontal_in_place(&mut cut);
        tw - left
    } else {
        left
    };
    let mut v = vec![0f32; 3 * th * tw];
    for (x, y, p) in cut.enumerate_pixels() {
        for c in 0..3 {
            v[(c * th + y as usize) * tw + x as usize] = p.0[c] as f32 / 127.5 - 1.0;
        }
    }
    Ok(Prepared {
        pixels: Tensor::from_vec(v, (3, th, tw), &Device::Cpu)?,
        original: (h, w),
        crop: (top, left),
    })
}

/// Writes images [N, 3, H, W] with values in [-1, 1] as PNGs `{stem}-{i}.png` in `dir`, plus a
/// grid of all of them as `grid.png`; returns the paths.
pub fn write_pngs(images: &Tensor, dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
    let (n, c, h, w) = images.dims4()?;
    if c != 3 {
        return Err(anyhow!("images have {c} channels, PNGs need 3"));
    }
    let data: Vec<f32> = images
        .to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1()?;
    let cols = (n as f64).sqrt().ceil() as usize;
    let rows = n.div_ceil(cols.max(1));
    let mut grid = image::RgbImage::new((cols * w) as u32, (rows * h) as u32);
    let mut paths = Vec::with_capacity(n + 1);
    for i in 0..n {
        let mut img = image::RgbImage::new(w as u32, h as u32);
        for y in 0..h {
            for x in 0..w {
                let px = |ch: usize| {
                    let v = data[((i * 3 + ch) * h + y) * w + x];
                    (((v + 1.0) * 127.5).round()).clamp(0.0, 255.0) as u8
                };
                let p = image::Rgb([px(0), px(1), px(2)]);
                img.put_pixel(x as u32, y as u32, p);
                grid.put_pixel(((i % cols) * w + x) as u32, ((i / cols) * h + y) as u32, p);
            }
        }
        let path = dir.join(format!("sample-{i:02}.png"));
        save_png(&img, &path)?;
        paths.push(path);
    }
    let path = dir.join("grid.png");
    save_png(&grid, &path)?;
    paths.push(path);
    Ok(paths)
}

fn save_png(img: &image::RgbImage, path: &Path) -> Result<()> {
    let tmp = path.with_extension("png.tmp");
    img.save_with_format(&tmp, image::ImageFormat::Png)
        .with_context(|| tmp.display().to_string())?;
    std::fs::rename(&tmp, path).with_context(|| path.display().to_string())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Crop::At` the corner a random crop drew cuts the same pixels (the MMD's real images are
    /// cut where the cache cut them).
    #[test]
    fn a_crop_at_a_drawn_corner_repeats_the_random_crop() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("sdxl-crop-at-{}", std::process::id()));
        crate::demo::write_images(&dir, 1, 3)?;
        let path = dir.join("000.png");
        let mut rng = SplitMix64::new(11);
        let random = prepare(&path, (24, 16), Crop::Random, false, &mut rng)?;
        let (top, left) = random.crop;
        let again = prepare(&path, (24, 16), Crop::At(top, left), false, &mut rng)?;
        assert_eq!(again.crop, random.crop);
        let diff = (again.pixels - &random.pixels)?.abs()?.sum_all()?;
        assert_eq!(diff.to_scalar::<f32>()?, 0.0);
        let center = prepare(&path, (24, 16), Crop::Center, false, &mut rng)?;
        assert_ne!(
            center.crop, random.crop,
            "the draw should differ from the center"
        );
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
