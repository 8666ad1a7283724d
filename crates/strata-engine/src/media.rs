//! Images in prompts: each image through the processor and the model's vision tower into
//! soft-token rows, and forwards whose image placeholder positions take those rows (the
//! rows of every image in prompt order; a forward never splits an image's run, so an image
//! attended bidirectionally sees all of itself). A model without a vision tower refuses an
//! image by name: never a text-only answer.

use crate::image::{ImageProcessor, Rgb8};
use crate::scorer::Scorer;
use crate::LoadedModel;
use anyhow::{bail, Context, Result};
use std::path::Path;
use strata_models::media::VisionSpec;
use strata_models::{Batch, Logits, SeqId};

/// Soft-token rows for a prompt: they replace the `placeholder` ids, in order.
pub struct Media {
    pub placeholder: u32,
    /// `[soft tokens, hidden]` over every image.
    pub rows: Vec<f32>,
    pub width: usize,
    /// Soft tokens of each image.
    pub counts: Vec<usize>,
}

impl Media {
    pub fn len(&self) -> usize {
        self.rows.len() / self.width.max(1)
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}

/// The model's vision spec, or why it takes no images.
pub fn vision_spec(m: &LoadedModel) -> Result<VisionSpec> {
    let what = format!("{} ({})", m.dir.display(), m.model_type);
    let Some(v) = m.model.vision() else {
        if m.arch.vision_tower() {
            bail!("{what}: its vision tower does not run on this device; images are refused, not ignored");
        }
        bail!("{what} has no vision tower: it reads text only");
    };
    Ok(v.spec())
}

/// `max_soft_tokens` of the processor the model directory `dir` asks for
/// (`preprocessor_config.json`, default 280): the most soft tokens one image becomes.
pub fn max_soft_tokens(dir: &Path) -> Result<usize> {
    let path = dir.join("preprocessor_config.json");
    Ok(match std::fs::read_to_string(&path) {
        Ok(text) => {
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            match v.get("max_soft_tokens") {
                None => 280,
                Some(x) => x.as_u64().ok_or_else(|| {
                    anyhow::anyhow!("{}: max_soft_tokens must be a whole number, got {x}", path.display())
                })? as usize,
            }
        }
        Err(_) => 280,
    })
}

/// Rows one forward must hold for the images of the model in `dir` (0 without a vision
/// tower): an image attended bidirectionally is computed in one forward, so prompts are
/// prefilled in chunks of at least this many rows, and the plan counts their activations.
pub fn image_rows(dir: &Path, arch: &dyn strata_models::Arch) -> Result<usize> {
    match arch.vision_tower() {
        true => max_soft_tokens(dir),
        false => Ok(0),
    }
}

/// The processor the model directory asks for ([`max_soft_tokens`]).
pub fn processor(m: &LoadedModel, spec: &VisionSpec) -> Result<ImageProcessor> {
    ImageProcessor::new(spec.patch_size, spec.pooling, max_soft_tokens(&m.dir)?)
}

/// Every image through the processor and the tower.
pub fn encode_images(m: &LoadedModel, images: &[Rgb8]) -> Result<Media> {
    let spec = vision_spec(m)?;
    encode_with(m.model.as_ref(), &processor(m, &spec)?, images)
}

/// Every image through `proc` and `model`'s tower.
pub fn encode_with(model: &dyn strata_models::Model, proc: &ImageProcessor, images: &[Rgb8]) -> Result<Media> {
    let Some(vision) = model.vision() else { bail!("the model has no vision tower: it reads text only") };
    let spec = vision.spec();
    let width = model.info().hidden_size;
    let mut media = Media { placeholder: spec.image_token_id, rows: Vec::new(), width, counts: Vec::new() };
    for img in images {
        let patches = proc.process(img)?;
        let rows = vision.encode(&patches)?;
        media.counts.push(rows.len() / width);
        media.rows.extend(rows);
    }
    Ok(media)
}

/// The prompt ids with each image's run (`<boi>`, a placeholder per soft token, `<eoi>`)
/// for `counts` images: every single placeholder (as a chat template writes one per
/// image) expands in order; without any, the runs go first (after a leading `bos`).
pub fn expand_runs(spec: &VisionSpec, ids: &[u32], counts: &[usize], bos: Option<u32>) -> Result<Vec<u32>> {
    let marks = ids.iter().filter(|&&t| t == spec.image_token_id).count();
    let mut out = Vec::with_capacity(ids.len() + counts.iter().sum::<usize>() + 2 * counts.len());
    if marks == 0 {
        let lead = usize::from(ids.first().is_some_and(|&t| Some(t) == bos));
        out.extend_from_slice(&ids[..lead]);
        for &n in counts {
            out.extend(image_run(spec, n));
        }
        out.extend_from_slice(&ids[lead..]);
        return Ok(out);
    }
    if marks != counts.len() {
        bail!("the prompt has {marks} image placeholders for {} images", counts.len());
    }
    let mut it = counts.iter();
    for &t in ids {
        match t == spec.image_token_id {
            true => out.extend(image_run(spec, *it.next().expect("counted above"))),
            false => out.push(t),
        }
    }
    Ok(out)
}

/// [`encode_images`] of image files.
pub fn encode_files(m: &LoadedModel, paths: &[impl AsRef<Path>]) -> Result<Media> {
    vision_spec(m)?;
    let images = paths.iter().map(|p| Rgb8::open(p.as_ref())).collect::<Result<Vec<_>>>()?;
    encode_images(m, &images)
}

/// The soft tokens `img` becomes under `proc`, without encoding it.
pub fn soft_tokens(spec: &VisionSpec, proc: &ImageProcessor, img: &Rgb8) -> Result<usize> {
    let (h, w) = proc.target_size(img.height, img.width)?;
    Ok(proc.soft_tokens((h / spec.patch_size) * (w / spec.patch_size)))
}

/// Image files as a request's media (encoded by the engine when the request starts),
/// with each image's soft tokens for [`expand_runs`].
pub fn open_files(m: &LoadedModel, paths: &[impl AsRef<Path>]) -> Result<(crate::serving::MediaInput, Vec<usize>)> {
    let spec = vision_spec(m)?;
    let processor = processor(m, &spec)?;
    let mut images = Vec::with_capacity(paths.len());
    let mut counts = Vec::with_capacity(paths.len());
    for p in paths {
        let p = p.as_ref();
        let img = Rgb8::open(p)?;
        counts.push(soft_tokens(&spec, &processor, &img).with_context(|| p.display().to_string())?);
        images.push(img);
    }
    Ok((crate::serving::MediaInput { images, processor }, counts))
}

/// An image's run of prompt ids: `<boi>`, the placeholder once per soft token, `<eoi>`.
pub fn image_run(spec: &VisionSpec, soft_tokens: usize) -> Vec<u32> {
    let mut run = vec![spec.boi_token_id];
    run.extend(std::iter::repeat_n(spec.image_token_id, soft_tokens));
    run.push(spec.eoi_token_id);
    run
}

/// Splits `ids` into forwards of at most `rows` rows; with `whole` (a bidirectional image
/// block, whose rows see each other) each run of placeholders stays in one forward.
pub fn chunks(ids: &[u32], placeholder: u32, rows: usize, whole: bool) -> Result<Vec<std::ops::Range<usize>>> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < ids.len() {
        let mut end = (start + rows).min(ids.len());
        if whole && end < ids.len() && ids[end] == placeholder && ids[end - 1] == placeholder {
            // Back up to the run's start.
            let run = ids[start..end].iter().rev().take_while(|&&t| t == placeholder).count();
            if run == end - start {
                let len = ids[start..].iter().take_while(|&&t| t == placeholder).count();
                bail!("an image of {len} soft tokens attends to itself in one forward, which holds {rows} rows");
            }
            end -= run;
        }
        out.push(start..end);
        start = end;
    }
    Ok(out)
}

/// Checks that `ids` hold one placeholder per soft token of `media`.
pub fn check_placeholders(ids: &[u32], media: &Media) -> Result<()> {
    let n = ids.iter().filter(|&&t| t == media.placeholder).count();
    if n != media.len() {
        bail!(
            "the ids hold {n} image placeholder tokens (id {}), but the image processor gives {} soft tokens \
             ({:?} per image)",
            media.placeholder,
            media.len(),
            media.counts
        );
    }
    Ok(())
}

/// Appends `ids` of `seq` to `batch`, placeholder ids as `media`'s rows from `*used` on.
pub fn push_rows(batch: &mut Batch, seq: SeqId, ids: &[u32], media: &Media, used: &mut usize, want: Logits) {
    let mut i = 0;
    while i < ids.len() {
        let image = ids[i] == media.placeholder;
        let n = ids[i..].iter().take_while(|&&t| (t == media.placeholder) == image).count();
        let w = match want {
            Logits::Last if i + n < ids.len() => Logits::None,
            w => w,
        };
        if image {
            let rows = &media.rows[*used * media.width..(*used + n) * media.width];
            batch.push_embeddings(seq, rows, media.width, w);
            *used += n;
        } else {
            batch.push(seq, &ids[i..i + n], w);
        }
        i += n;
    }
}

/// Rows a forward may take of `tokens[computed..]` (at most `n`) without splitting a run
/// of placeholders: the chunk ends before a run it would cut (0 when it starts one).
pub fn whole_runs(tokens: &[u32], computed: usize, n: usize, placeholder: u32) -> usize {
    let end = computed + n;
    if n == 0 || end >= tokens.len() || tokens[end] != placeholder || tokens[end - 1] != placeholder {
        return n;
    }
    n - tokens[computed..end].iter().rev().take_while(|&&t| t == placeholder).count()
}

/// The longest run of placeholders in `tokens`.
pub fn longest_run(tokens: &[u32], placeholder: u32) -> usize {
    tokens.split(|&t| t != placeholder).map(<[u32]>::len).max().unwrap_or(0)
}

impl Scorer<'_> {
    /// Whether the model's images attend to themselves bidirectionally.
    fn bidirectional_images(&self) -> bool {
        self.model.vision().is_some_and(|v| v.spec().bidirectional)
    }

    /// One forward over `ids` appended to the sequence, placeholder ids taking `media`'s
    /// rows from `*used` on.
    fn forward_media(&mut self, ids: &[u32], media: &Media, used: &mut usize, want: Logits) -> Result<()> {
        self.batch.clear();
        push_rows(&mut self.batch, self.seq, ids, media, used, want);
        self.session.forward(&self.batch)?;
        self.tokens.extend_from_slice(ids);
        Ok(())
    }

    /// Logits for `ids` (holding `media`'s placeholders) from a fresh cache: every
    /// position, or the last.
    pub fn logits_with_media(&mut self, ids: &[u32], media: &Media, all: bool) -> Result<Vec<Vec<f32>>> {
        check_placeholders(ids, media)?;
        if ids.len() > self.context() {
            bail!("{} ids do not fit the context of {} positions", ids.len(), self.context());
        }
        self.session.truncate(self.seq, 0);
        self.tokens.clear();
        let vocab = self.model.info().vocab_size;
        let parts = chunks(ids, media.placeholder, self.session.max_rows(), self.bidirectional_images())?;
        let n = parts.len();
        let (mut out, mut used) = (Vec::new(), 0);
        for (i, part) in parts.into_iter().map(|r| &ids[r]).enumerate() {
            let want = if all {
                Logits::All
            } else if i + 1 == n {
                Logits::Last
            } else {
                Logits::None
            };
            self.forward_media(part, media, &mut used, want)?;
            out.extend(self.session.logits().chunks(vocab).map(|r| r.to_vec()));
        }
        Ok(out)
    }

    /// Prefills `prompt` (holding `media`'s placeholders) from a fresh cache and leaves
    /// the last position's logits ready; later steps decode as usual.
    pub fn prefill_with_media(&mut self, prompt: &[u32], media: &Media) -> Result<usize> {
        check_placeholders(prompt, media)?;
        self.session.truncate(self.seq, 0);
        self.tokens.clear();
        let parts = chunks(prompt, media.placeholder, self.session.max_rows(), self.bidirectional_images())?;
        let n = parts.len();
        let mut used = 0;
        for (i, part) in parts.into_iter().map(|r| &prompt[r]).enumerate() {
            self.forward_media(part, media, &mut used, if i + 1 == n { Logits::Last } else { Logits::None })?;
        }
        self.take_logits()?;
        Ok(prompt.len())
    }
}

#[cfg(test)]
mod tests {
    use super::chunks;

    #[test]
    fn forwards_keep_image_runs_whole() {
        let p = 9;
        let ids = [1, 2, p, p, p, p, 3, 4, 5, 6];
        assert_eq!(chunks(&ids, p, 4, true).unwrap(), vec![0..2, 2..6, 6..10]);
        assert_eq!(chunks(&ids, p, 7, true).unwrap(), vec![0..7, 7..10]);
        assert_eq!(chunks(&ids, p, 100, true).unwrap(), vec![0..10]);
        assert!(chunks(&ids, p, 3, true).unwrap_err().to_string().contains("4 soft tokens"));
        // Causal images split like text.
        assert_eq!(chunks(&ids, p, 3, false).unwrap(), vec![0..3, 3..6, 6..9, 9..10]);
    }
}
