//! An expert file overwritten in place (same size, NaN bytes) fails the request that
//! reads it, naming the file, layer and expert, instead of producing empty text; the
//! damaged bytes are never published into a slot, so nothing later computes on them.

mod common;

use std::io::{Seek, SeekFrom, Write};
use std::path::Path;
use strata_engine::experts::{RuntimeOptions, UsageSetting};
use strata_engine::{GenerateRequest, LoadOptions, LoadedModel, SamplingParams};
use strata_kernels::QuantKind;
use strata_models::convert::{convert, ConvertOptions};
use strata_storage::ExpertManifest;

#[test]
fn nan_overwritten_experts_fail_the_read_naming_file_layer_and_expert() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = tempfile::tempdir().unwrap();
    let opts = ConvertOptions { experts: QuantKind::Int8Row, mtp_experts: QuantKind::Int8Row };
    convert(&root.join("fixtures/glm5/dsa-sparse"), dir.path(), &opts, &mut |_, _| {}).unwrap();
    let manifest = ExpertManifest::read(dir.path()).unwrap();
    let main = manifest.tier("main").unwrap();
    assert_eq!(main.checksums.len(), main.locations.len(), "convert records a checksum per region");
    // NaNs over the first 256 bytes of every main-tier region, in place.
    for loc in &main.locations {
        let path = dir.path().join(&manifest.files[loc.file]);
        let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.seek(SeekFrom::Start(loc.offset)).unwrap();
        f.write_all(&f32::NAN.to_le_bytes().repeat(64)).unwrap();
    }
    let load = LoadOptions {
        device: strata_engine::Device::Cpu,
        budget: Some(u64::MAX / 4),
        gpu_budget: None,
        context: 256,
        runtime: RuntimeOptions {
            working_slots: 8,
            max_slots_per_layer: Some(2),
            usage: UsageSetting::Off,
            ..Default::default()
        },
        ..Default::default()
    };
    let m = LoadedModel::open_with(dir.path(), &load).unwrap();
    for attempt in 0..2 {
        let req = GenerateRequest::new(vec![5, 17, 33, 2], 4, SamplingParams::default());
        let err = format!("{:#}", common::try_generate(&m, &req).unwrap_err());
        assert!(err.contains("checksum mismatch"), "attempt {attempt}: {err}");
        assert!(err.contains("experts/experts-00000.bin"), "attempt {attempt}: {err}");
        let named = err.split("layer ").skip(1).any(|rest| {
            let mut words = rest.split_whitespace();
            words.next().is_some_and(|l| l.parse::<usize>().is_ok())
                && words.next() == Some("expert")
                && words.next().is_some_and(|e| e.trim_end_matches(':').parse::<usize>().is_ok())
        });
        assert!(named, "attempt {attempt}: no `layer L expert E` in {err}");
    }
    let report = m.experts.as_ref().unwrap().end_turn().unwrap();
    assert_eq!(report.slots.ready + report.slots.leased, 0, "no damaged expert was published: {:?}", report.slots);
}
