//! `strata atlas render`: one self-contained HTML page (inline CSS, JS and data, no
//! network): a layer x expert grid coloured by each expert's top topic, its
//! specialisation as intensity, strong specialists outlined; hover details, a legend
//! (click a topic to isolate it) and the leave-one-prompt-out score.

use anyhow::Result;
use std::collections::BTreeMap;
use std::fmt::Write;
use strata_residency::atlas::AtlasFile;

/// Qualitative palette (Tableau-like); more topics continue around the hue circle.
const PALETTE: [(u8, u8, u8); 12] = [
    (0x4e, 0x79, 0xa7),
    (0xf2, 0x8e, 0x2b),
    (0xe1, 0x57, 0x59),
    (0x76, 0xb7, 0xb2),
    (0x59, 0xa1, 0x4f),
    (0xed, 0xc9, 0x48),
    (0xb0, 0x7a, 0xa1),
    (0xff, 0x9d, 0xa7),
    (0x9c, 0x75, 0x5f),
    (0x17, 0xbe, 0xcf),
    (0xbc, 0xbd, 0x22),
    (0x7f, 0x3c, 0x8d),
];
/// The colour of "no preference".
const NEUTRAL: (u8, u8, u8) = (0xe9, 0xeb, 0xef);

fn hsl(h: f64, s: f64, l: f64) -> (u8, u8, u8) {
    let c = (1.0 - (2.0 * l - 1.0).abs()) * s;
    let x = c * (1.0 - ((h / 60.0) % 2.0 - 1.0).abs());
    let (r, g, b) = match (h / 60.0) as u32 {
        0 => (c, x, 0.0),
        1 => (x, c, 0.0),
        2 => (0.0, c, x),
        3 => (0.0, x, c),
        4 => (x, 0.0, c),
        _ => (c, 0.0, x),
    };
    let m = l - c / 2.0;
    let f = |v: f64| ((v + m) * 255.0).round().clamp(0.0, 255.0) as u8;
    (f(r), f(g), f(b))
}

fn topic_colour(i: usize) -> (u8, u8, u8) {
    PALETTE.get(i).copied().unwrap_or_else(|| hsl((i as f64 * 137.508) % 360.0, 0.55, 0.5))
}

fn mix(a: (u8, u8, u8), b: (u8, u8, u8), t: f64) -> String {
    let f = |x: u8, y: u8| (x as f64 + (y as f64 - x as f64) * t).round() as u8;
    format!("#{:02x}{:02x}{:02x}", f(a.0, b.0), f(a.1, b.1), f(a.2, b.2))
}

fn hex(c: (u8, u8, u8)) -> String {
    mix(c, c, 0.0)
}

/// Colour weight of a specialisation: a square-root ramp from a hint of the topic's
/// colour (no preference) to full colour at `scale`, so weak preferences stay legible.
fn intensity(spec: f64, scale: f64) -> f64 {
    0.2 + 0.8 * (spec / scale).clamp(0.0, 1.0).sqrt()
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

const STYLE: &str = r#"
:root{--ink:#1d2330;--muted:#667085;--line:#d9dde5;--bg:#f7f8fa}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;color:var(--ink);background:var(--bg)}
header{padding:22px 28px 8px}
h1{margin:0;font-size:24px;font-weight:650}
h1 span{color:var(--muted);font-weight:500}
.sub{color:var(--muted);margin:4px 0 0}
.cards{display:flex;gap:14px;padding:12px 28px;flex-wrap:wrap}
.card{background:#fff;border:1px solid var(--line);border-radius:10px;padding:12px 16px;min-width:170px}
.card .num{font-size:26px;font-weight:700}
.card.big .num{color:#2b6cb0}
.card .lbl{color:var(--muted);font-size:12.5px}
main{display:flex;gap:18px;padding:8px 28px;align-items:flex-start;flex-wrap:wrap}
.gridwrap{background:#fff;border:1px solid var(--line);border-radius:10px;padding:12px;overflow:auto;max-width:100%}
table.grid{border-collapse:separate;border-spacing:2px}
table.grid td{width:var(--cw);height:var(--ch);min-width:var(--cw);padding:0;border-radius:3px;cursor:crosshair}
table.grid th{font-size:11px;font-weight:500;color:var(--muted);padding:0 6px 0 0;text-align:right;white-space:nowrap}
table.grid thead th{text-align:center;padding:0 0 3px;font-variant-numeric:tabular-nums}
td.strong{box-shadow:inset 0 0 0 2px rgba(20,24,33,.55)}
td.none{background:repeating-linear-gradient(45deg,#f1f2f5 0 3px,#e1e4ea 3px 6px)}
td.unseen{background:#fff;outline:1px dashed #cfd4dc}
td.hl{outline:2px solid #111;outline-offset:0}
.dim td[data-t]:not(.on){opacity:.12}
.dim td.none,.dim td.unseen{opacity:.12}
aside{background:#fff;border:1px solid var(--line);border-radius:10px;padding:14px 16px;width:320px;min-height:240px}
aside h3{margin:0 0 6px;font-size:16px}
aside .kv{display:grid;grid-template-columns:auto 1fr;gap:2px 12px;font-size:13px;margin-bottom:10px}
aside .kv span:nth-child(odd){color:var(--muted)}
.bar{display:grid;grid-template-columns:92px 1fr 52px;align-items:center;gap:6px;font-size:12px;margin:2px 0}
.bar i{display:block;height:10px;border-radius:2px}
.bar b{font-weight:500;text-align:right;font-variant-numeric:tabular-nums}
.legend{padding:10px 28px;display:flex;flex-wrap:wrap;gap:8px 10px;align-items:center}
.chip{display:flex;align-items:center;gap:6px;background:#fff;border:1px solid var(--line);border-radius:16px;padding:3px 10px 3px 5px;cursor:pointer;user-select:none;font-size:13px}
.chip i{width:16px;height:16px;border-radius:4px;display:inline-block}
.chip small{color:var(--muted)}
.chip.off{opacity:.45}
.scale{display:flex;align-items:center;gap:8px;color:var(--muted);font-size:12.5px;margin-left:8px}
.scale .ramp{width:140px;height:12px;border-radius:3px;background:linear-gradient(90deg,#c6cfda,#4e79a7)}
section.more{padding:4px 28px 8px}
details{background:#fff;border:1px solid var(--line);border-radius:10px;padding:8px 14px;margin:8px 0}
summary{cursor:pointer;font-weight:600}
table.list{border-collapse:collapse;font-size:12.5px;margin-top:6px}
table.list td,table.list th{padding:2px 10px;border-bottom:1px solid #eef0f4;text-align:left}
table.list td.n{text-align:right;font-variant-numeric:tabular-nums}
.bad{color:#c53030;font-weight:600}
footer{color:var(--muted);font-size:12px;padding:6px 28px 24px}
"#;

const SCRIPT: &str = r#"
(function(){
  const data = JSON.parse(document.getElementById('atlas-data').textContent);
  const detail = document.getElementById('detail');
  const grid = document.getElementById('grid');
  const pct = x => (x * 100).toFixed(1) + '%';
  function row(k, v){ return '<span>' + k + '</span><span>' + v + '</span>'; }
  function show(td){
    const key = td.dataset.key;
    const e = data.experts[key];
    let h = '<h3>expert ' + key.replace(':', ' : ') + '</h3>';
    if (!e) {
      const n = data.totals[key] || 0;
      h += '<div class="kv">' + row('layer : expert', key) + row('selections', n) +
        row('label', n ? 'none (too sparse or not replicated)' : 'never selected') + '</div>';
      detail.innerHTML = h; return;
    }
    h += '<div class="kv">' +
      row('top topic', '<b style="color:' + data.colours[e.t] + '">' + data.categories[e.t] + '</b>') +
      row('label', e.s >= data.strong ? 'strong specialist' : 'generalist') +
      row('specialisation', e.s.toFixed(3)) +
      row('lift of top topic', e.l.toFixed(2) + '\u00d7') +
      row('selections', e.n) +
      row('fired in', e.f + ' of ' + e.r + ' ' + data.categories[e.t] + ' prompts') + '</div>';
    const order = e.a.map((v, i) => [v, i]).sort((x, y) => y[0] - x[0]);
    for (const [v, i] of order) {
      h += '<div class="bar"><span>' + data.categories[i] + '</span><i style="width:' +
        Math.max(1, v * 100).toFixed(1) + '%;background:' + data.colours[i] + '"></i><b>' + pct(v) + '</b></div>';
    }
    detail.innerHTML = h;
  }
  let last = null;
  grid.addEventListener('mouseover', ev => {
    const td = ev.target.closest('td[data-key]');
    if (!td || td === last) return;
    if (last) last.classList.remove('hl');
    td.classList.add('hl'); last = td; show(td);
  });
  const chips = document.querySelectorAll('.chip[data-t]');
  let only = null;
  chips.forEach(ch => ch.addEventListener('click', () => {
    const t = ch.dataset.t;
    only = only === t ? null : t;
    grid.classList.toggle('dim', only !== null);
    grid.querySelectorAll('td[data-t]').forEach(td => td.classList.toggle('on', td.dataset.t === only));
    chips.forEach(c => c.classList.toggle('off', only !== null && c.dataset.t !== only));
  }));
  const first = grid.querySelector('td.strong') || grid.querySelector('td[data-t]');
  if (first) { first.classList.add('hl'); last = first; show(first); }
  console.log('atlas-ready ' + grid.querySelectorAll('td[data-key]').length + ' cells');
})();
"#;

/// The page for `atlas` (its `validation` is shown when present).
pub fn render(atlas: &AtlasFile) -> Result<String> {
    let a = &atlas.analysis;
    let cats = &a.categories;
    let colours: Vec<(u8, u8, u8)> = (0..cats.len()).map(topic_colour).collect();
    let thr = a.method.strong_threshold;
    let max_spec = a.experts.iter().map(|e| e.specialization).fold(0.0, f64::max);
    // Full colour at the strongest specialisation (or the strong threshold, if none
    // reaches it): the ramp spans what the atlas holds.
    let scale = max_spec.max(thr).max(1e-9);
    let mut totals: BTreeMap<(usize, usize), u64> = BTreeMap::new();
    for r in &atlas.runs {
        for &(l, e, n) in &r.counts {
            *totals.entry((l, e)).or_insert(0) += n;
        }
    }
    let by_key: BTreeMap<(usize, usize), &strata_residency::atlas::AtlasExpert> =
        a.experts.iter().map(|e| ((e.layer, e.expert), e)).collect();
    let cat_index = |name: &str| cats.iter().position(|c| c == name).unwrap_or(0);

    let n_exp = atlas.model.experts_per_layer;
    let n_lay = atlas.model.layers.len().max(1);
    let cw = (880 / n_exp.max(1)).clamp(4, 24);
    let ch = (420 / n_lay).clamp(4, 56);
    let mut h = String::with_capacity(64 * 1024);
    let title = format!("Expert Atlas \u{2014} {}", esc(&atlas.model.name));
    write!(h, "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><meta name=\"viewport\" content=\"width=device-width,initial-scale=1\"><title>{title}</title><style>{STYLE}</style></head><body>")?;
    write!(
        h,
        "<header><h1>Expert Atlas <span>{}</span></h1><p class=\"sub\">{} \u{b7} {} routed layers \u{d7} {} experts, top-{} \u{b7} {} prompts in {} categories, each from a fresh cache{} \u{b7} kept: \u{2265} {} selections and top topic in \u{2265} {} prompts</p></header>",
        esc(&atlas.model.name),
        esc(&atlas.model.model_type),
        atlas.model.layers.len(),
        n_exp,
        atlas.model.top_k,
        a.run_count,
        cats.len(),
        if atlas.settings.max_tokens > 0 { format!(" + {} greedy tokens", atlas.settings.max_tokens) } else { String::new() },
        a.method.min_count,
        a.method.min_runs
    )?;
    h.push_str("<section class=\"cards\">");
    if let Some(v) = &atlas.validation {
        write!(
            h,
            "<div class=\"card big\" id=\"score\"><div class=\"num\">{}</div><div class=\"lbl\">leave-one-prompt-out accuracy<br>{}/{} prompts \u{b7} chance {} \u{b7} top-{} sets</div></div>",
            pct(v.accuracy),
            v.hits,
            v.trials,
            pct(v.chance),
            v.top_k
        )?;
    }
    let s = &a.summary;
    write!(
        h,
        "<div class=\"card\"><div class=\"num\">{}</div><div class=\"lbl\">experts labelled<br>of {} seen ({} sparse, {} unreplicated)</div></div>",
        s.experts_kept, s.experts_seen, s.dropped_sparse, s.dropped_unreplicated
    )?;
    write!(
        h,
        "<div class=\"card\"><div class=\"num\">{}</div><div class=\"lbl\">strong specialists<br>specialisation \u{2265} {thr} ({} of labelled)</div></div>",
        s.strong_specialists,
        pct(s.strong_specialist_rate)
    )?;
    h.push_str("</section>");

    // Legend: one chip per topic with its labelled and strong counts.
    h.push_str("<section class=\"legend\">");
    for (i, c) in cats.iter().enumerate() {
        let kept = a.experts.iter().filter(|e| &e.top_topic == c).count();
        let strong = a.experts.iter().filter(|e| &e.top_topic == c && e.specialization >= thr).count();
        write!(
            h,
            "<span class=\"chip\" data-t=\"{i}\" title=\"click to isolate\"><i style=\"background:{}\"></i>{} <small>{kept} \u{b7} {strong} strong</small></span>",
            hex(colours[i]),
            esc(c)
        )?;
    }
    write!(
        h,
        "<span class=\"scale\">specialisation 0<span class=\"ramp\"></span>{scale:.2} (square-root scale) \u{b7} outlined: strong \u{b7} <i style=\"display:inline-block;width:14px;height:14px;border-radius:3px;background:repeating-linear-gradient(45deg,#f1f2f5 0 3px,#e1e4ea 3px 6px)\"></i> not labelled</span></section>"
    )?;

    // The grid.
    write!(h, "<main><div class=\"gridwrap\"><table class=\"grid\" id=\"grid\" style=\"--cw:{cw}px;--ch:{ch}px\"><thead><tr><th></th>")?;
    let every = if n_exp <= 64 { 1 } else { 16 };
    for e in 0..n_exp {
        if e % every == 0 {
            write!(h, "<th>{e}</th>")?;
        } else {
            h.push_str("<th></th>");
        }
    }
    h.push_str("</tr></thead><tbody>");
    for &layer in &atlas.model.layers {
        write!(h, "<tr><th>L{layer}</th>")?;
        for e in 0..n_exp {
            let key = format!("{layer}:{e}");
            match by_key.get(&(layer, e)) {
                Some(x) => {
                    let t = cat_index(&x.top_topic);
                    let colour = mix(NEUTRAL, colours[t], intensity(x.specialization, scale));
                    let strong = if x.specialization >= thr { " class=\"strong\"" } else { "" };
                    write!(h, "<td data-key=\"{key}\" data-t=\"{t}\"{strong} style=\"background:{colour}\"></td>")?;
                }
                None if totals.contains_key(&(layer, e)) => write!(h, "<td data-key=\"{key}\" class=\"none\"></td>")?,
                None => write!(h, "<td data-key=\"{key}\" class=\"unseen\"></td>")?,
            }
        }
        h.push_str("</tr>");
    }
    h.push_str("</tbody></table></div><aside id=\"detail\">Hover an expert.</aside></main>");

    // Validation and strongest specialists.
    h.push_str("<section class=\"more\">");
    if let Some(v) = &atlas.validation {
        write!(h, "<details><summary>Validation per prompt ({}/{} correct)</summary><table class=\"list\"><tr><th>category</th><th>prompt</th><th>predicted</th><th>own share</th><th>best other</th></tr>", v.hits, v.trials)?;
        for t in &v.trials_by_prompt {
            let pred =
                if t.correct { esc(&t.predicted) } else { format!("<span class=\"bad\">{}</span>", esc(&t.predicted)) };
            write!(
                h,
                "<tr><td>{}</td><td class=\"n\">{}</td><td>{pred}</td><td class=\"n\">{:.3}</td><td class=\"n\">{:.3}</td></tr>",
                esc(&t.category),
                t.prompt,
                t.own_share,
                t.best_other_share
            )?;
        }
        h.push_str("</table></details>");
    }
    h.push_str("<details><summary>Strongest specialists</summary><table class=\"list\"><tr><th>expert</th><th>top topic</th><th>specialisation</th><th>lift</th><th>selections</th><th>fired</th></tr>");
    for x in a.experts.iter().take(24) {
        write!(
            h,
            "<tr><td>{}:{}</td><td>{}</td><td class=\"n\">{:.3}</td><td class=\"n\">{:.2}\u{d7}</td><td class=\"n\">{}</td><td class=\"n\">{}/{}</td></tr>",
            x.layer,
            x.expert,
            esc(&x.top_topic),
            x.specialization,
            x.top_lift,
            x.total,
            x.reliability.fired_runs,
            x.reliability.total_runs
        )?;
    }
    h.push_str("</table></details></section>");
    let p = &atlas.probes.provenance;
    write!(
        h,
        "<footer>Probe set: {} ({}) \u{2014} {}. Method: {}; p(topic | expert) from category means; specialisation = 1 \u{2212} entropy / ln {}. Written by strata.</footer>",
        esc(&p.source),
        esc(&p.source_commit),
        esc(&p.method),
        esc(&a.method.normalization),
        cats.len()
    )?;

    // Data for the hover panel.
    let experts: serde_json::Map<String, serde_json::Value> = a
        .experts
        .iter()
        .map(|x| {
            let v = serde_json::json!({
                "t": cat_index(&x.top_topic),
                "s": x.specialization,
                "l": x.top_lift,
                "n": x.total,
                "f": x.reliability.fired_runs,
                "r": x.reliability.total_runs,
                "a": cats.iter().map(|c| x.affinity.get(c).copied().unwrap_or(0.0)).collect::<Vec<_>>(),
            });
            (format!("{}:{}", x.layer, x.expert), v)
        })
        .collect();
    let data = serde_json::json!({
        "categories": cats,
        "colours": colours.iter().map(|&c| hex(c)).collect::<Vec<_>>(),
        "strong": thr,
        "experts": experts,
        "totals": totals.iter().map(|(&(l, e), &n)| (format!("{l}:{e}"), n)).collect::<BTreeMap<_, _>>(),
    });
    let json = serde_json::to_string(&data)?.replace("</", "<\\/");
    writeln!(
        h,
        "<script id=\"atlas-data\" type=\"application/json\">{json}</script><script>{SCRIPT}</script></body></html>"
    )?;
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colours_and_escaping() {
        assert_eq!(hex(topic_colour(0)), "#4e79a7");
        assert_eq!(mix((0, 0, 0), (255, 255, 255), 0.5), "#808080");
        assert_eq!(hex(hsl(0.0, 1.0, 0.5)), "#ff0000");
        assert_ne!(topic_colour(12), topic_colour(13));
        assert_eq!(intensity(0.0, 0.8), 0.2);
        assert_eq!(intensity(0.8, 0.8), 1.0);
        assert_eq!(intensity(2.0, 0.8), 1.0);
        assert_eq!(esc("<a & \"b\">"), "&lt;a &amp; &quot;b&quot;&gt;");
    }
}
