//! Image input for models with a vision tower: the processor's patches go in, soft tokens
//! (rows of the text model's input embeddings) come out; the engine splices them at the
//! image placeholder positions.

use anyhow::Result;

/// One image's patches as the image processor gives them.
#[derive(Clone, Debug, Default)]
pub struct ImagePatches {
    /// `[patches, patch * patch * 3]` in [0, 1], (row, column, channel) within a patch.
    pub pixels: Vec<f32>,
    /// (x, y) of each patch, row-major over the patch grid.
    pub positions: Vec<(u32, u32)>,
}

/// What the engine needs to know to build an image's prompt run and processor input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VisionSpec {
    pub patch_size: usize,
    /// Patches per side pooled into one soft token.
    pub pooling: usize,
    pub image_token_id: u32,
    pub boi_token_id: u32,
    pub eoi_token_id: u32,
    /// Image tokens attend bidirectionally within their image (Gemma 4's
    /// `use_bidirectional_attention: "vision"`).
    pub bidirectional: bool,
}

/// A model's vision tower.
pub trait Vision: Send + Sync {
    fn spec(&self) -> VisionSpec;
    /// The image's soft tokens, `[soft, hidden]` in the text model's embedding space.
    fn encode(&self, image: &ImagePatches) -> Result<Vec<f32>>;
}
