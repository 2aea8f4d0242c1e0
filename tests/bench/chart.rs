//! Horizontal bar charts as SVG, for the benchmark report: one bar per figure, the ceiling
//! first and drawn apart, each bar labelled with its value (and its ratio to the ceiling).

use std::fmt::Write;

/// Figures to show side by side, with the ceiling they are measured against, if any.
pub struct Comparison {
    /// File stem of the chart: `docs/bench/<stem>.svg`.
    pub stem: String,
    pub title: String,
    pub unit: String,
    pub ceiling: Option<(String, f64)>,
    pub bars: Vec<(String, f64)>,
}

impl Comparison {
    pub fn new(stem: &str, title: &str, unit: &str, ceiling: (&str, f64), bars: Vec<(String, f64)>) -> Comparison {
        Comparison {
            stem: stem.into(),
            title: title.into(),
            unit: unit.into(),
            ceiling: Some((ceiling.0.into(), ceiling.1)),
            bars,
        }
    }

    /// Figures with no ceiling (latencies, times).
    pub fn plain(stem: &str, title: &str, unit: &str, bars: Vec<(String, f64)>) -> Comparison {
        Comparison {
            stem: stem.into(),
            title: title.into(),
            unit: unit.into(),
            ceiling: None,
            bars,
        }
    }

    pub fn svg(&self) -> String {
        const WIDTH: f64 = 760.0;
        const LABEL: f64 = 250.0;
        const BAR: f64 = 26.0;
        const GAP: f64 = 10.0;
        const TOP: f64 = 44.0;
        let rows: Vec<(&str, f64, bool)> = self
            .ceiling
            .iter()
            .map(|(l, v)| (l.as_str(), *v, true))
            .chain(self.bars.iter().map(|(l, v)| (l.as_str(), *v, false)))
            .collect();
        let max = rows.iter().map(|r| r.1).fold(0.0_f64, f64::max).max(f64::MIN_POSITIVE);
        let span = WIDTH - LABEL - 170.0;
        let height = TOP + rows.len() as f64 * (BAR + GAP) + 10.0;
        let mut svg = String::new();
        let _ = writeln!(
            svg,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="13">"#
        );
        let _ = writeln!(svg, r##"<rect width="100%" height="100%" fill="#ffffff"/>"##);
        let _ = writeln!(
            svg,
            r#"<text x="10" y="24" font-size="15" font-weight="bold">{} ({})</text>"#,
            escape(&self.title),
            escape(&self.unit)
        );
        for (i, (label, value, is_ceiling)) in rows.iter().enumerate() {
            let y = TOP + i as f64 * (BAR + GAP);
            let w = (value / max * span).max(1.0);
            let fill = if *is_ceiling { "#9aa5b1" } else { "#2f6fb0" };
            let name = if *is_ceiling {
                format!("{label} (ceiling)")
            } else {
                label.to_string()
            };
            let _ = writeln!(
                svg,
                r#"<text x="{}" y="{}" text-anchor="end">{}</text>"#,
                LABEL - 8.0,
                y + BAR * 0.68,
                escape(&name)
            );
            let _ = writeln!(
                svg,
                r#"<rect x="{LABEL}" y="{y}" width="{w:.1}" height="{BAR}" fill="{fill}"/>"#
            );
            let ratio = match (&self.ceiling, is_ceiling) {
                (Some((_, c)), false) if *c > 0.0 => format!("  ×{}", format_ratio(value / c)),
                _ => String::new(),
            };
            let _ = writeln!(
                svg,
                r#"<text x="{:.1}" y="{}">{}{}</text>"#,
                LABEL + w + 6.0,
                y + BAR * 0.68,
                format_value(*value),
                ratio
            );
        }
        svg.push_str("</svg>\n");
        svg
    }
}

/// A ratio to its ceiling, with enough digits to be read when it is small.
pub fn format_ratio(r: f64) -> String {
    if r >= 0.01 {
        format!("{r:.2}")
    } else {
        format!("{r:.4}")
    }
}

pub fn format_value(v: f64) -> String {
    if v >= 1000.0 {
        let whole = v.round() as u64;
        let s = whole.to_string();
        let mut out = String::new();
        for (i, c) in s.chars().enumerate() {
            if i > 0 && (s.len() - i).is_multiple_of(3) {
                out.push(',');
            }
            out.push(c);
        }
        out
    } else if v >= 10.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}
