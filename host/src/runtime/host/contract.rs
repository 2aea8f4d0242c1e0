//! `obx:plugin/contract`: payload schemas declared while the manifest is read. They are
//! only collected here; the loader checks them with the rest of the manifest
//! (`runtime::contract`). Bounded, so that a manifest cannot grow the host's memory.

use crate::runtime::bindings::contract::Host;
use crate::runtime::manifest::PayloadContract;
use crate::runtime::state::CallState;
use crate::text::shown;

/// Declarations one plugin may make.
pub(crate) const MAX_DECLARATIONS: usize = 256;
/// The longest schema, and the longest example, in bytes.
pub(crate) const MAX_SCHEMA_BYTES: usize = 64 * 1024;
/// The longest topic and event type a declaration may name: Kafka's longest topic name, and
/// the manifest's longest event type. Longer ones were kept whole until the manifest's check:
/// 256 declarations naming one 64 MiB string held 32 GiB of the host's memory.
const MAX_TOPIC_BYTES: usize = 249;
const MAX_EVENT_TYPE_BYTES: usize = 1024;

impl Host for CallState {
    fn declare_payload(&mut self, topic: String, event_type: String, schema: String, example: Option<String>) {
        if self.tx.is_some() {
            // Inside a handler: the contract is the manifest's, fixed at load.
            return;
        }
        if let Err(e) = self.collect(topic, event_type, schema, example) {
            self.declaration_error.get_or_insert(e);
        }
    }
}

impl CallState {
    fn collect(
        &mut self,
        topic: String,
        event_type: String,
        schema: String,
        example: Option<String>,
    ) -> Result<(), String> {
        if self.declared.len() >= MAX_DECLARATIONS {
            return Err(format!("more than {MAX_DECLARATIONS} payload declarations"));
        }
        if topic.len() > MAX_TOPIC_BYTES || event_type.len() > MAX_EVENT_TYPE_BYTES {
            return Err(format!(
                "a payload declaration names a topic of {} bytes or an event type of {} (at most {MAX_TOPIC_BYTES} and \
                 {MAX_EVENT_TYPE_BYTES})",
                topic.len(),
                event_type.len()
            ));
        }
        let what = format!("the payload schema of {} on {}", shown(&event_type), shown(&topic));
        if schema.len() > MAX_SCHEMA_BYTES || example.as_ref().is_some_and(|e| e.len() > MAX_SCHEMA_BYTES) {
            return Err(format!(
                "{what}: a schema or example is larger than {MAX_SCHEMA_BYTES} bytes"
            ));
        }
        let schema = serde_json::from_str(&schema).map_err(|e| format!("{what} is not JSON: {e}"))?;
        let example = example
            .map(|e| {
                serde_json::from_str(&e).map_err(|e| {
                    format!(
                        "the example of {} on {} is not JSON: {e}",
                        shown(&event_type),
                        shown(&topic)
                    )
                })
            })
            .transpose()?;
        self.declared.push(PayloadContract {
            topic,
            event_type,
            schema,
            example,
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Instant;

    use super::*;
    use crate::config::Limits;
    use crate::runtime::{Manifest, PluginIdentity};

    /// A declaration naming a topic or an event type longer than any the manifest allows is
    /// refused as it is made, not kept for the manifest's check: 256 of them naming one 64 MiB
    /// string held 32 GiB.
    #[test]
    fn a_declaration_of_a_huge_topic_or_event_type_is_refused_and_not_kept() {
        let manifest = Manifest::empty("p");
        let identity = Arc::new(PluginIdentity::new(&manifest, Default::default(), false));
        let mut state = CallState::new(
            identity,
            Arc::new(Limits::default()),
            None,
            Instant::now(),
            "m".into(),
            None,
        );
        let huge = "t".repeat(1 << 20);
        for (topic, event_type) in [(huge.as_str(), "E"), ("t", huge.as_str())] {
            let refused = state.collect(topic.into(), event_type.into(), "{}".into(), None);
            assert!(refused.unwrap_err().contains("at most"));
        }
        assert!(state.declared.is_empty());
        state.collect("t".into(), "E".into(), "{}".into(), None).unwrap();
        assert_eq!(state.declared.len(), 1);
    }
}
