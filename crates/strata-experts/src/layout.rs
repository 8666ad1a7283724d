//! What a model's routed experts are, as the streaming runtime needs to know them.

/// Routed experts of an architecture: which layers, how many, their shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoeLayout {
    /// Model layer ids with routed experts.
    pub layers: Vec<usize>,
    pub experts_per_layer: usize,
    pub top_k: usize,
    pub hidden: usize,
    /// Width of one expert's intermediate activation.
    pub inter: usize,
    /// MTP layer ids (`num_hidden_layers ..`), whose experts may be in the checkpoint.
    pub mtp_layers: Vec<usize>,
}
