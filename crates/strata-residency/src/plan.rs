//! The residency plan: how many expert slots a byte budget affords, decided from
//! header-only sizes before any weight is read ("The plan" in residency.md).
//!
//! Also the `fit` report (every line item, human table + JSON) and the size parser
//! behind `--budget`.

use std::fmt;

use serde::Serialize;

/// The reference engine's default working (miss/scratch) bank.
pub const DEFAULT_WORKING_SLOTS: usize = 64;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Everything the plan needs; all sizes in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PlanInput {
    /// The whole process budget (`--budget`).
    pub budget_bytes: u64,
    /// Resident weights + KV cache for the reserved context + transients + allocator and
    /// runtime reserve (+ any auxiliary slab such as the MTP tier's).
    pub fixed_bytes: u64,
    /// One expert region (gate, up, down and scales), the same for every slot.
    pub slot_bytes: u64,
    /// Number of sparse (MoE) layers managed by this plan.
    pub sparse_layers: usize,
    /// Global miss/scratch bank; a forward's wave holds at most this many misses.
    pub working_slots: usize,
    /// Slots reserved for pinned experts.
    pub pinned_experts: usize,
    /// Optional cap on the per-layer LRU depth.
    pub max_slots_per_layer: Option<usize>,
}

impl PlanInput {
    /// The main tier's input with the reference defaults: 64 working slots, no pins,
    /// no per-layer cap.
    pub fn new(budget_bytes: u64, fixed_bytes: u64, slot_bytes: u64, sparse_layers: usize) -> Self {
        PlanInput {
            budget_bytes,
            fixed_bytes,
            slot_bytes,
            sparse_layers,
            working_slots: DEFAULT_WORKING_SLOTS,
            pinned_experts: 0,
            max_slots_per_layer: None,
        }
    }

    /// The MTP tier's own small plan: one layer, `min(n_experts, top_k * draft_tokens)`
    /// working slots (a verify forward's union), `pinned` pins and exactly one resident
    /// slot. Its fixed bytes are 0 and its budget the whole budget: the main plan is the
    /// single source of accounting truth and counts this tier's `slab_bytes` inside its
    /// own `fixed_bytes`.
    pub fn mtp(
        budget_bytes: u64,
        slot_bytes: u64,
        n_experts: usize,
        top_k: usize,
        draft_tokens: usize,
        pinned: usize,
    ) -> Self {
        PlanInput {
            budget_bytes,
            fixed_bytes: 0,
            slot_bytes,
            sparse_layers: 1,
            working_slots: n_experts.min(top_k.saturating_mul(draft_tokens)),
            pinned_experts: pinned,
            max_slots_per_layer: Some(1),
        }
    }
}

/// The admissible fixed-capacity layout for a [`PlanInput`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ResidencyPlan {
    pub input: PlanInput,
    /// Per-layer LRU slots (>= 1).
    pub slots_per_layer: usize,
    /// `working + pinned + sparse_layers * slots_per_layer`.
    pub total_slots: usize,
    /// `total_slots * slot_bytes`.
    pub slab_bytes: u64,
    /// `budget - fixed - slab` (never negative for an admitted plan).
    pub headroom_bytes: u64,
}

/// Why a plan was refused. `Display` names every number involved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanError {
    /// A field is out of range (zero slot size, no sparse layers, ...).
    InvalidInput(String),
    /// Even one slot per layer plus the working and pinned banks does not fit.
    DoesNotFit {
        input: PlanInput,
        /// `fixed + (working + pinned + sparse_layers) * slot`.
        required_bytes: u128,
    },
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlanError::InvalidInput(msg) => write!(f, "invalid residency plan input: {msg}"),
            PlanError::DoesNotFit { input, required_bytes } => {
                let i = input;
                let slots = i.working_slots as u128 + i.pinned_experts as u128 + i.sparse_layers as u128;
                write!(
                    f,
                    "budget {} does not fit the smallest expert plan: fixed {} + \
                     (working {} + pinned {} + one slot for each of {} sparse layers = {} slots) \
                     x slot {} = {} required; short by {} bytes",
                    format_bytes(i.budget_bytes),
                    format_bytes(i.fixed_bytes),
                    i.working_slots,
                    i.pinned_experts,
                    i.sparse_layers,
                    slots,
                    format_bytes(i.slot_bytes),
                    format_bytes_u128(*required_bytes),
                    required_bytes - i.budget_bytes as u128,
                )
            }
        }
    }
}

impl std::error::Error for PlanError {}

/// Plans the slab: refuses when `fixed + (working + pinned + sparse_layers) * slot >
/// budget`, else `slots_per_layer = floor((budget - fixed - (working + pinned) * slot) /
/// (sparse_layers * slot))`, capped by `max_slots_per_layer`.
pub fn plan(input: PlanInput) -> Result<ResidencyPlan, PlanError> {
    if input.slot_bytes == 0 {
        return Err(PlanError::InvalidInput("slot_bytes must be positive".into()));
    }
    if input.sparse_layers == 0 {
        return Err(PlanError::InvalidInput("sparse_layers must be positive".into()));
    }
    if input.working_slots == 0 {
        return Err(PlanError::InvalidInput(
            "working_slots must be positive (misses load into the working bank)".into(),
        ));
    }
    if input.max_slots_per_layer == Some(0) {
        return Err(PlanError::InvalidInput("max_slots_per_layer must be positive when given".into()));
    }
    // u128 arithmetic, saturating: products of usize counts and u64 sizes may still
    // exceed it, and such a plan can only not fit.
    let slot = input.slot_bytes as u128;
    let banks = input.working_slots as u128 + input.pinned_experts as u128;
    let required = (banks + input.sparse_layers as u128).saturating_mul(slot).saturating_add(input.fixed_bytes as u128);
    if required > input.budget_bytes as u128 {
        return Err(PlanError::DoesNotFit { input, required_bytes: required });
    }
    let variable = input.budget_bytes as u128 - input.fixed_bytes as u128 - banks * slot;
    let mut per_layer = variable / (input.sparse_layers as u128 * slot);
    if let Some(cap) = input.max_slots_per_layer {
        per_layer = per_layer.min(cap as u128);
    }
    let slots_per_layer =
        usize::try_from(per_layer).map_err(|_| PlanError::InvalidInput("slots per layer exceed usize".into()))?;
    let total = banks + input.sparse_layers as u128 * per_layer;
    let total_slots = usize::try_from(total).map_err(|_| PlanError::InvalidInput("total slots exceed usize".into()))?;
    // slab <= budget - fixed <= u64::MAX, so these conversions cannot fail.
    let slab_bytes = (total * slot) as u64;
    let headroom_bytes = input.budget_bytes - input.fixed_bytes - slab_bytes;
    Ok(ResidencyPlan { input, slots_per_layer, total_slots, slab_bytes, headroom_bytes })
}

impl ResidencyPlan {
    /// Slots in all per-layer LRU banks together.
    pub fn layer_slots(&self) -> usize {
        self.input.sparse_layers * self.slots_per_layer
    }

    /// `fixed + slab`: what the plan commits of the budget.
    pub fn planned_bytes(&self) -> u64 {
        self.input.fixed_bytes + self.slab_bytes
    }

    /// The fit report for this plan: the caller's itemisation of the fixed bytes
    /// (weights, KV, transients, reserve, ...) followed by the three slab banks. If the
    /// fixed items sum to less than `input.fixed_bytes`, the remainder is shown as
    /// "other fixed" so the total always matches the plan.
    pub fn fit_report(&self, fixed_items: Vec<FitItem>) -> FitReport {
        let mut items = fixed_items;
        let itemised: u64 = items.iter().map(|i| i.bytes).sum();
        if itemised < self.input.fixed_bytes {
            items.push(FitItem::new("other fixed", self.input.fixed_bytes - itemised));
        }
        let slot = self.input.slot_bytes;
        items.push(FitItem::new(
            format!("expert slab: working {} x {}", self.input.working_slots, format_bytes(slot)),
            self.input.working_slots as u64 * slot,
        ));
        items.push(FitItem::new(
            format!("expert slab: pinned {} x {}", self.input.pinned_experts, format_bytes(slot)),
            self.input.pinned_experts as u64 * slot,
        ));
        items.push(FitItem::new(
            format!(
                "expert slab: {} layers x {} slots x {}",
                self.input.sparse_layers,
                self.slots_per_layer,
                format_bytes(slot)
            ),
            self.layer_slots() as u64 * slot,
        ));
        FitReport::new(self.input.budget_bytes, items)
    }
}

/// One line of a fit report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FitItem {
    pub name: String,
    pub bytes: u64,
}

impl FitItem {
    pub fn new(name: impl Into<String>, bytes: u64) -> Self {
        FitItem { name: name.into(), bytes }
    }
}

/// Every line item against the budget. `Display` is the human table of `strata fit`;
/// `Serialize` is its `--json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FitReport {
    pub items: Vec<FitItem>,
    pub budget: u64,
    pub total: u64,
    /// `budget - total`; negative when the items do not fit.
    pub headroom: i128,
    pub fits: bool,
}

impl FitReport {
    /// Builds a report from any items (also for budgets the plan refuses, so the user
    /// sees what does not fit).
    pub fn new(budget: u64, items: Vec<FitItem>) -> Self {
        let total_wide: u128 = items.iter().map(|i| i.bytes as u128).sum();
        let total = u64::try_from(total_wide).unwrap_or(u64::MAX);
        let headroom = budget as i128 - total_wide as i128;
        FitReport { items, budget, total, headroom, fits: headroom >= 0 }
    }
}

impl FitReport {
    /// Pretty JSON for `strata fit --json`.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a fit report always serializes")
    }
}

impl fmt::Display for FitReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width = self.items.iter().map(|i| i.name.len()).chain(["headroom".len()]).max().unwrap_or(0);
        let line = |f: &mut fmt::Formatter<'_>, name: &str, human: String, bytes: String| {
            writeln!(f, "{name:<width$}  {human:>12}  {bytes:>16}")
        };
        line(f, "item", "size".into(), "bytes".into())?;
        for item in &self.items {
            line(f, &item.name, human_size(item.bytes as u128), item.bytes.to_string())?;
        }
        writeln!(f, "{}", "-".repeat(width + 32))?;
        line(f, "total", human_size(self.total as u128), self.total.to_string())?;
        line(f, "budget", human_size(self.budget as u128), self.budget.to_string())?;
        let sign = if self.headroom < 0 { "-" } else { "" };
        line(f, "headroom", format!("{sign}{}", human_size(self.headroom.unsigned_abs())), self.headroom.to_string())?;
        if self.fits {
            write!(f, "fits: yes")
        } else {
            write!(f, "fits: NO (over budget by {} bytes)", self.headroom.unsigned_abs())
        }
    }
}

/// "10.00 GiB" at or above 1 GiB, else "512.00 MiB".
fn human_size(bytes: u128) -> String {
    if bytes >= GIB as u128 {
        format!("{:.2} GiB", bytes as f64 / GIB as f64)
    } else {
        format!("{:.2} MiB", bytes as f64 / MIB as f64)
    }
}

/// "2.00 GiB (2147483648 bytes)": human and exact, for error messages.
pub fn format_bytes(bytes: u64) -> String {
    format_bytes_u128(bytes as u128)
}

fn format_bytes_u128(bytes: u128) -> String {
    format!("{} ({bytes} bytes)", human_size(bytes))
}

/// Parses a byte size: plain bytes (`123456`), or a number with a decimal unit
/// (`KB MB GB TB`, powers of 1000) or binary unit (`KiB MiB GiB TiB`, powers of 1024),
/// case-insensitive, fractions allowed with a unit (`1.5GB`; rounded down to whole
/// bytes). Bare `K`/`M`/`G`/`T` are refused as ambiguous.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let s = text.trim();
    if s.is_empty() {
        return Err("empty size: expected e.g. 512MiB, 2GiB, 1.5GB or 123456".into());
    }
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (number, unit) = (&s[..split], s[split..].trim());
    if number.is_empty() {
        return Err(format!("size {text:?}: expected a number before the unit"));
    }
    let multiplier: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => KIB,
        "mib" => MIB,
        "gib" => GIB,
        "tib" => 1 << 40,
        "k" | "m" | "g" | "t" => {
            return Err(format!(
                "size {text:?}: unit {unit:?} is ambiguous; write {u}iB (binary) or {u}B (decimal)",
                u = unit.to_ascii_uppercase()
            ))
        }
        _ => return Err(format!("size {text:?}: unknown unit {unit:?} (use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)")),
    };
    let (whole, frac) = match number.split_once('.') {
        Some((w, f)) => (w, f),
        None => (number, ""),
    };
    if (whole.is_empty() && frac.is_empty()) || frac.contains('.') {
        return Err(format!("size {text:?}: expected a number before the unit"));
    }
    if !frac.is_empty() && multiplier == 1 {
        return Err(format!("size {text:?}: a byte count must be a whole number"));
    }
    if frac.len() > 18 {
        return Err(format!("size {text:?}: too many decimal places"));
    }
    let too_big = || format!("size {text:?} is too large (max {} bytes)", u64::MAX);
    let whole_value: u128 = if whole.is_empty() { 0 } else { whole.parse::<u128>().map_err(|_| too_big())? };
    let mut bytes = whole_value.checked_mul(multiplier as u128).ok_or_else(too_big)?;
    if !frac.is_empty() {
        let frac_value: u128 = frac.parse().map_err(|_| too_big())?;
        bytes += frac_value * multiplier as u128 / 10u128.pow(frac.len() as u32);
    }
    u64::try_from(bytes).map_err(|_| too_big())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(budget: u64, fixed: u64, slot: u64, layers: usize, working: usize, pinned: usize) -> PlanInput {
        PlanInput {
            budget_bytes: budget,
            fixed_bytes: fixed,
            slot_bytes: slot,
            sparse_layers: layers,
            working_slots: working,
            pinned_experts: pinned,
            max_slots_per_layer: None,
        }
    }

    #[test]
    fn plan_divides_the_variable_bytes_among_layers() {
        // budget 1000, fixed 100, slot 10, 4 layers, 8 working, 2 pinned:
        // variable = 1000 - 100 - 100 = 800 -> 800 / 40 = 20 per layer.
        let p = plan(input(1000, 100, 10, 4, 8, 2)).unwrap();
        assert_eq!(p.slots_per_layer, 20);
        assert_eq!(p.total_slots, 8 + 2 + 80);
        assert_eq!(p.slab_bytes, 900);
        assert_eq!(p.headroom_bytes, 0);
        assert_eq!(p.layer_slots(), 80);
        assert_eq!(p.planned_bytes(), 1000);
    }

    #[test]
    fn plan_floors_and_reports_headroom() {
        // variable = 1039 - 100 - 100 = 839 -> floor(839 / 40) = 20, headroom 39.
        let p = plan(input(1039, 100, 10, 4, 8, 2)).unwrap();
        assert_eq!(p.slots_per_layer, 20);
        assert_eq!(p.headroom_bytes, 39);
    }

    #[test]
    fn plan_respects_the_cap() {
        let mut i = input(1000, 100, 10, 4, 8, 2);
        i.max_slots_per_layer = Some(3);
        let p = plan(i).unwrap();
        assert_eq!(p.slots_per_layer, 3);
        assert_eq!(p.total_slots, 22);
        assert_eq!(p.slab_bytes, 220);
        assert_eq!(p.headroom_bytes, 1000 - 100 - 220);
    }

    #[test]
    fn plan_admits_exactly_one_slot_per_layer_at_the_floor() {
        // fixed + (8 + 2 + 4) * 10 = 240 exactly.
        let p = plan(input(240, 100, 10, 4, 8, 2)).unwrap();
        assert_eq!(p.slots_per_layer, 1);
        assert_eq!(p.headroom_bytes, 0);
    }

    #[test]
    fn constructors_use_the_reference_defaults() {
        let main = PlanInput::new(10 * GIB, GIB, 8 * MIB, 75);
        assert_eq!((main.working_slots, main.pinned_experts, main.max_slots_per_layer), (64, 0, None));
        let mtp = PlanInput::mtp(10 * GIB, 16 * MIB, 256, 8, 3, 2);
        assert_eq!((mtp.sparse_layers, mtp.working_slots, mtp.pinned_experts), (1, 24, 2));
        let p = plan(mtp).unwrap();
        assert_eq!((p.slots_per_layer, p.total_slots), (1, 27));
        assert_eq!(p.slab_bytes, 27 * 16 * MIB);
        assert_eq!(PlanInput::mtp(1, 1, 4, 8, 3, 0).working_slots, 4, "capped by the expert count");
    }

    #[test]
    fn plan_refuses_one_byte_short_with_every_number() {
        let err = plan(input(239, 100, 10, 4, 8, 2)).unwrap_err();
        assert_eq!(err, PlanError::DoesNotFit { input: input(239, 100, 10, 4, 8, 2), required_bytes: 240 });
        let msg = err.to_string();
        for needle in [
            "239 bytes",
            "100 bytes",
            "working 8",
            "pinned 2",
            "4 sparse layers",
            "14 slots",
            "10 bytes",
            "240 bytes",
            "short by 1 bytes",
        ] {
            assert!(msg.contains(needle), "{needle:?} missing from {msg}");
        }
    }

    #[test]
    fn plan_refuses_fixed_above_budget_and_huge_inputs_without_overflow() {
        assert!(matches!(plan(input(10, 11, 1, 1, 1, 0)), Err(PlanError::DoesNotFit { .. })));
        let err = plan(input(u64::MAX, u64::MAX, u64::MAX, usize::MAX, usize::MAX, usize::MAX));
        assert!(matches!(err, Err(PlanError::DoesNotFit { .. })));
        let p = plan(input(u64::MAX, 0, 1, 1, 1, 0)).unwrap();
        assert_eq!(p.slots_per_layer as u64, u64::MAX - 1);
    }

    #[test]
    fn plan_rejects_invalid_inputs() {
        for bad in [
            input(100, 0, 0, 1, 1, 0),
            input(100, 0, 1, 0, 1, 0),
            input(100, 0, 1, 1, 0, 0),
            PlanInput { max_slots_per_layer: Some(0), ..input(100, 0, 1, 1, 1, 0) },
        ] {
            let err = plan(bad).unwrap_err();
            assert!(matches!(err, PlanError::InvalidInput(_)), "{err}");
        }
    }

    #[test]
    fn fit_report_lists_items_totals_and_headroom() {
        let p = plan(input(10 * GIB, 3 * GIB, 64 * MIB, 4, 8, 2)).unwrap();
        let report = p.fit_report(vec![
            FitItem::new("resident weights", 2 * GIB),
            FitItem::new("KV cache (4096 tokens)", 512 * MIB),
        ]);
        assert!(report.fits);
        assert_eq!(report.total, p.planned_bytes());
        assert_eq!(report.headroom, p.headroom_bytes as i128);
        let names: Vec<_> = report.items.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(names[0], "resident weights");
        assert_eq!(names[2], "other fixed");
        assert_eq!(report.items[2].bytes, 512 * MIB);
        let table = report.to_string();
        assert!(table.contains("2.00 GiB"), "{table}");
        assert!(table.contains("512.00 MiB"), "{table}");
        assert!(table.contains(&(2 * GIB).to_string()), "{table}");
        assert!(table.contains("fits: yes"), "{table}");
        let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
        assert_eq!(json["budget"], 10 * GIB);
        assert_eq!(json["items"][0]["name"], "resident weights");
        assert_eq!(json["fits"], true);
    }

    #[test]
    fn fit_report_shows_negative_headroom() {
        let report = FitReport::new(100, vec![FitItem::new("weights", 150)]);
        assert!(!report.fits);
        assert_eq!(report.headroom, -50);
        let table = report.to_string();
        assert!(table.contains("over budget by 50 bytes"), "{table}");
        assert!(table.contains("-50"), "{table}");
    }

    #[test]
    fn parse_size_accepts_the_documented_forms() {
        assert_eq!(parse_size("512MiB"), Ok(512 * MIB));
        assert_eq!(parse_size("2GiB"), Ok(2 * GIB));
        assert_eq!(parse_size("1.5GB"), Ok(1_500_000_000));
        assert_eq!(parse_size("123456"), Ok(123_456));
        assert_eq!(parse_size(" 1.5 GiB "), Ok(1_610_612_736));
        assert_eq!(parse_size("4kib"), Ok(4096));
        assert_eq!(parse_size("7B"), Ok(7));
        assert_eq!(parse_size("2TB"), Ok(2_000_000_000_000));
        assert_eq!(parse_size(".5KiB"), Ok(512));
        assert_eq!(parse_size("0.1KiB"), Ok(102)); // rounded down
        assert_eq!(parse_size(&u64::MAX.to_string()), Ok(u64::MAX));
    }

    #[test]
    fn parse_size_errors_are_clear() {
        let cases = [
            ("", "empty"),
            ("GiB", "number"),
            ("1.2.3GB", "number"),
            ("12XB", "unknown unit"),
            ("2G", "ambiguous"),
            ("1.5", "whole number"),
            ("-1GiB", "number"),
            ("99999999999999999999", "too large"),
            ("20000000000GiB", "too large"),
        ];
        for (text, needle) in cases {
            let err = parse_size(text).unwrap_err();
            assert!(err.contains(needle), "{text:?}: {err}");
        }
    }
}
