//! corefs engine: the on-disk format, copy-on-write metadata trees, transactions and the commit
//! state machine, the per-shard fsync log and its replay. It runs on any
//! [`nvme::BlockDevice`]; one thread may drive every shard (tests), or reactors spread shards
//! over cores.
//!
//! Not built yet: this crate is the engine issue's work. It deliberately exports nothing, so
//! nothing can depend on a half-made engine.
