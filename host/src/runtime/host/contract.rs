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
