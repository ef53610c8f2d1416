//! A tracing subscriber for tests that records every span as it is created, as
//! `name{field=value ...}` (fields in the order the span declares them). Included with
//! `#[path]` by the tests that need it (they live in two crates: engine and reactor).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// Records each span's name and fields; clones share the record.
#[derive(Clone, Default)]
pub struct SpanRecorder(Arc<Recorded>);

#[derive(Default)]
struct Recorded {
    spans: Mutex<Vec<String>>,
    next_id: AtomicU64,
}

impl SpanRecorder {
    /// The spans created so far, in order.
    pub fn spans(&self) -> Vec<String> {
        self.0.spans.lock().unwrap().clone()
    }
}

struct Fields(String);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!(" {}={value:?}", field.name()));
    }
}

impl Subscriber for SpanRecorder {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let mut fields = Fields(String::new());
        span.record(&mut fields);
        let name = span.metadata().name();
        let span = format!("{name}{{{}}}", fields.0.trim());
        self.0.spans.lock().unwrap().push(span);
        // Ids are non-zero.
        Id::from_u64(self.0.next_id.fetch_add(1, Ordering::Relaxed) + 1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, _: &Event<'_>) {}
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}
