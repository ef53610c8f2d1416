//! corefs reactors: per-core threads that own shards and their device queues, the cross-core
//! commit coordinator, and the client API.
//!
//! Not built yet (the reactor issue). It deliberately exports nothing.
