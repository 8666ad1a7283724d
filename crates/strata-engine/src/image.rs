//! Gemma 4's image processor, as transformers' `Gemma4ImageProcessor` (torchvision
//! backend): decode (PNG, JPEG, WebP, GIF's first frame; converted to RGB, transparency
//! composited over white), resize keeping
//! the aspect ratio to the largest size whose sides are multiples of `pooling * patch` and
//! whose patches fit `max_soft_tokens * pooling^2` (bicubic with antialiasing, as
//! torchvision's uint8 path computes it: separable passes, horizontal first, 16-bit
//! fixed-point weights, each pass rounded to 8 bits), rescale to [0, 1], cut into `patch x patch` patches in row-major
//! order, each laid out (row, column, channel); the soft-token count is
//! `patches / pooling^2`.

use anyhow::{bail, Context, Result};
use std::path::Path;
use strata_models::media::ImagePatches;

/// The `max_soft_tokens` values transformers accepts.
pub const SOFT_TOKEN_BUDGETS: [usize; 5] = [70, 140, 280, 560, 1120];

/// An RGB image, 8 bits a channel, row-major.
#[derive(Clone, Debug)]
pub struct Rgb8 {
    pub width: usize,
    pub height: usize,
    pub data: Vec<u8>,
}

impl Rgb8 {
    /// Reads an image file (the first frame of an animation).
    pub fn open(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).with_context(|| format!("{}: cannot read the image", path.display()))?;
        Self::decode(&bytes).with_context(|| format!("{}", path.display()))
    }

    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let img = image::load_from_memory(bytes).context("not a PNG, JPEG, WebP or GIF image")?;
        let (w, h) = (img.width() as usize, img.height() as usize);
        if !img.color().has_alpha() {
            return Ok(Self { width: w, height: h, data: img.to_rgb8().into_raw() });
        }
        // transformers' `convert_to_rgb`: composited over white (PIL's alpha_composite).
        let data = img.to_rgba8().into_raw().chunks_exact(4).flat_map(|p| over_white(p[0], p[1], p[2], p[3])).collect();
        Ok(Self { width: w, height: h, data })
    }
}

/// A pixel over an opaque white background, in PIL's fixed point (7 fractional bits,
/// division by 255 as two shifts).
fn over_white(r: u8, g: u8, b: u8, a: u8) -> [u8; 3] {
    let a = a as u32;
    let (c1, c2) = (a << 7, (255 - a) << 7);
    let div255 = |v: u32| ((v >> 8) + v) >> 8;
    [r, g, b].map(|c| (div255(c as u32 * c1 + 255 * c2 + (0x80 << 7)) >> 7) as u8)
}

/// The processor's settings.
#[derive(Clone, Copy, Debug)]
pub struct ImageProcessor {
    pub patch_size: usize,
    pub pooling: usize,
    pub max_soft_tokens: usize,
}

impl ImageProcessor {
    pub fn new(patch_size: usize, pooling: usize, max_soft_tokens: usize) -> Result<Self> {
        if !SOFT_TOKEN_BUDGETS.contains(&max_soft_tokens) {
            bail!("max_soft_tokens must be one of {SOFT_TOKEN_BUDGETS:?}, got {max_soft_tokens}");
        }
        Ok(Self { patch_size, pooling, max_soft_tokens })
    }

    /// The size (height, width) an image of `height x width` is resized to.
    pub fn target_size(&self, height: usize, width: usize) -> Result<(usize, usize)> {
        let max_patches = self.max_soft_tokens * self.pooling * self.pooling;
        let target_px = (max_patches * self.patch_size * self.patch_size) as f64;
        let factor = (target_px / (height * width) as f64).sqrt();
        let side = self.pooling * self.patch_size;
        let mut th = ((factor * height as f64) / side as f64).floor() as usize * side;
        let mut tw = ((factor * width as f64) / side as f64).floor() as usize * side;
        if th == 0 && tw == 0 {
            bail!("a {width} x {height} image cannot be resized to whole {side}-pixel blocks");
        }
        let max_side = (max_patches / (self.pooling * self.pooling)) * side;
        if th == 0 {
            th = side;
            tw = ((width / height) * side).min(max_side);
        } else if tw == 0 {
            tw = side;
            th = ((height / width) * side).min(max_side);
        }
        if (th * tw) as f64 > target_px {
            bail!("a {width} x {height} image resized to {tw} x {th} would exceed {max_patches} patches");
        }
        Ok((th, tw))
    }

    /// The patches of `img` (resized as needed).
    pub fn process(&self, img: &Rgb8) -> Result<ImagePatches> {
        let (th, tw) = self.target_size(img.height, img.width)?;
        let resized = if (th, tw) == (img.height, img.width) { img.clone() } else { resize_bicubic(img, th, tw) };
        let p = self.patch_size;
        let (ph, pw) = (th / p, tw / p);
        let mut pixels = Vec::with_capacity(th * tw * 3);
        let mut positions = Vec::with_capacity(ph * pw);
        for py in 0..ph {
            for px in 0..pw {
                for r in 0..p {
                    let row = (py * p + r) * tw + px * p;
                    for &v in &resized.data[row * 3..(row + p) * 3] {
                        pixels.push(v as f32 / 255.0);
                    }
                }
                positions.push((px as u32, py as u32));
            }
        }
        Ok(ImagePatches { pixels, positions })
    }

    /// Soft tokens of an image of `patches` patches.
    pub fn soft_tokens(&self, patches: usize) -> usize {
        patches / (self.pooling * self.pooling)
    }
}

/// Keys' cubic convolution (a = -0.5), PIL's and torchvision's bicubic filter.
fn cubic(x: f64) -> f64 {
    let a = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * a
    } else {
        0.0
    }
}

/// For each output index, the first input index and the normalised weights (antialiased:
/// the filter widens by the downscale factor).
fn weights(input: usize, output: usize) -> Vec<(usize, Vec<f64>)> {
    let scale = input as f64 / output as f64;
    let filter_scale = scale.max(1.0);
    let support = 2.0 * filter_scale;
    (0..output)
        .map(|i| {
            let center = (i as f64 + 0.5) * scale;
            let lo = ((center - support + 0.5) as i64).max(0) as usize;
            let hi = ((center + support + 0.5) as i64).min(input as i64) as usize;
            let mut w: Vec<f64> = (lo..hi).map(|j| cubic((j as f64 - center + 0.5) / filter_scale)).collect();
            let sum: f64 = w.iter().sum();
            if sum != 0.0 {
                w.iter_mut().for_each(|v| *v /= sum);
            }
            (lo, w)
        })
        .collect()
}

/// One pass's weights in 16-bit fixed point, as torch's uint8 path holds them: the most
/// fractional bits (up to 22) that keep the largest weight below 2^15.
struct Fixed {
    taps: Vec<(usize, Vec<i64>)>,
    bits: u32,
}

impl Fixed {
    fn new(input: usize, output: usize) -> Self {
        let w = weights(input, output);
        let max = w.iter().flat_map(|(_, w)| w.iter().copied()).fold(0.0f64, f64::max);
        let mut bits = 0;
        while bits < 22 && ((0.5 + max * (1u64 << (bits + 1)) as f64) as i64) < (1 << 15) {
            bits += 1;
        }
        let one = (1u64 << bits) as f64;
        let taps = w
            .into_iter()
            .map(|(lo, w)| {
                (lo, w.iter().map(|&v| if v < 0.0 { (v * one - 0.5) as i64 } else { (v * one + 0.5) as i64 }).collect())
            })
            .collect();
        Self { taps, bits }
    }

    /// `sum(src[lo + k] * w[k])` rounded back to 8 bits.
    fn apply(&self, out: usize, src: impl Fn(usize) -> u8) -> u8 {
        let (lo, w) = &self.taps[out];
        let mut acc: i64 = 1 << (self.bits.max(1) - 1);
        for (k, wk) in w.iter().enumerate() {
            acc += src(lo + k) as i64 * wk;
        }
        (acc >> self.bits).clamp(0, 255) as u8
    }
}

fn resize_bicubic(img: &Rgb8, height: usize, width: usize) -> Rgb8 {
    // Horizontal pass, then vertical (each skipped when that side keeps its size).
    let mut mid = img.clone();
    if width != img.width {
        let fx = Fixed::new(img.width, width);
        let mut data = vec![0u8; img.height * width * 3];
        for y in 0..img.height {
            let row = &img.data[y * img.width * 3..(y + 1) * img.width * 3];
            for x in 0..width {
                for c in 0..3 {
                    data[(y * width + x) * 3 + c] = fx.apply(x, |j| row[j * 3 + c]);
                }
            }
        }
        mid = Rgb8 { width, height: img.height, data };
    }
    if height == img.height {
        return mid;
    }
    let fy = Fixed::new(img.height, height);
    let mut out = vec![0u8; height * width * 3];
    for y in 0..height {
        for x in 0..width {
            for c in 0..3 {
                out[(y * width + x) * 3 + c] = fy.apply(y, |j| mid.data[(j * width + x) * 3 + c]);
            }
        }
    }
    Rgb8 { width, height, data: out }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_sizes_follow_the_reference_rules() {
        let p = ImageProcessor::new(16, 3, 280).unwrap();
        // transformers: a 224 x 160 (w x h) image at 280 gives 2,394 patches (266 soft tokens).
        let (h, w) = p.target_size(160, 224).unwrap();
        assert_eq!((h / 16) * (w / 16), 2394);
        assert_eq!(p.soft_tokens(2394), 266);
        let p70 = ImageProcessor::new(16, 3, 70).unwrap();
        assert_eq!(p70.target_size(288, 480).unwrap(), (288, 480));
        // A thin strip: one block high, as wide as the budget allows.
        assert_eq!(p70.target_size(10, 4000).unwrap(), (48, 3360));
        assert!(ImageProcessor::new(16, 3, 100).is_err());
    }

    #[test]
    fn downscaling_a_flat_image_keeps_it_flat() {
        let img = Rgb8 { width: 97, height: 61, data: [10u8, 200, 77].repeat(97 * 61) };
        let out = resize_bicubic(&img, 48, 48);
        assert!(out.data.chunks(3).all(|px| px == [10, 200, 77]));
    }
}
