//! W3C trace context (`traceparent`), carried from an HTTP command, through the outbox row,
//! into the Kafka headers, and out of each consumed event into its handler's span:
//! `00-<trace-id: 32 hex>-<parent span id: 16 hex>-<flags: 2 hex>`.
//!
//! Every command and every event runs in a span of its own, with `trace_id`, `span_id` and
//! `parent_span_id` fields; the events it emits carry a `traceparent` naming that span as
//! their parent.

use std::fmt::Write as _;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub sampled: bool,
}

impl TraceContext {
    /// Parses a `traceparent` header. Unknown versions are read as version 00 when they
    /// are long enough, as the spec asks; all-zero ids are invalid.
    pub fn parse(header: &str) -> Option<TraceContext> {
        let parts: Vec<&str> = header.trim().split('-').collect();
        if parts.len() < 4 || parts[0].len() != 2 || parts[0] == "ff" {
            return None;
        }
        if parts[0] == "00" && parts.len() != 4 {
            return None;
        }
        let trace_id: [u8; 16] = decode_hex(parts[1])?;
        let span_id: [u8; 8] = decode_hex(parts[2])?;
        let flags: [u8; 1] = decode_hex(parts[3])?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(TraceContext {
            trace_id,
            span_id,
            sampled: flags[0] & 1 == 1,
        })
    }

    /// A new trace, for a command that came without one.
    pub fn root() -> TraceContext {
        let id = uuid::Uuid::new_v4().into_bytes();
        TraceContext {
            trace_id: id,
            span_id: new_span_id(),
            sampled: true,
        }
    }

    /// The context of a span that `self` is the parent of: same trace, new span id.
    pub fn child(&self) -> TraceContext {
        TraceContext {
            span_id: new_span_id(),
            ..*self
        }
    }

    /// The span of work that runs under `parent`, or a new trace when there is none.
    pub fn child_of(parent: Option<&TraceContext>) -> TraceContext {
        parent.map(TraceContext::child).unwrap_or_else(TraceContext::root)
    }

    /// The `traceparent` header: `00-<trace id>-<span id>-<flags>`, written in one allocation.
    pub fn header(&self) -> String {
        let mut header = String::with_capacity(55);
        header.push_str("00-");
        push_hex(&mut header, &self.trace_id);
        header.push('-');
        push_hex(&mut header, &self.span_id);
        header.push_str(if self.sampled { "-01" } else { "-00" });
        header
    }

    pub fn trace_id(&self) -> String {
        hex::encode(self.trace_id)
    }

    pub fn span_id(&self) -> String {
        hex::encode(self.span_id)
    }
}

fn new_span_id() -> [u8; 8] {
    let bytes = uuid::Uuid::new_v4().into_bytes();
    let mut id = [0u8; 8];
    id.copy_from_slice(&bytes[..8]);
    if id == [0; 8] {
        id[7] = 1;
    }
    id
}

/// Appends `bytes` as lowercase hex digits.
fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 0x0f)] as char);
    }
}

fn decode_hex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != N * 2 || !s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return None;
    }
    let mut out = [0u8; N];
    hex::decode_to_slice(s, &mut out).ok()?;
    Some(out)
}

/// The parent span id of a span, as a field value: empty for a root.
pub fn parent_field(parent: Option<&TraceContext>) -> String {
    let mut s = String::new();
    if let Some(p) = parent {
        let _ = write!(s, "{}", p.span_id());
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_children() {
        let h = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let t = TraceContext::parse(h).unwrap();
        assert_eq!(t.header(), h);
        let unsampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";
        assert_eq!(TraceContext::parse(unsampled).unwrap().header(), unsampled);
        let c = t.child();
        assert_eq!(c.trace_id, t.trace_id);
        assert_ne!(c.span_id, t.span_id);
    }

    #[test]
    fn invalid_headers_are_refused() {
        for h in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert!(TraceContext::parse(h).is_none(), "{h}");
        }
    }
}
