//! Raw declarations of the plugin ABI (version 3), one for one with
//! `python/opbridge/include/opbridge/plugin.h`. They live in the SDK crate, which plugin authors
//! link and which has no third-party dependencies (its DLPack part is `opbridge-dtype`'s); the
//! loader uses the very same definitions, so host and plugins cannot drift apart. Nothing here is checked; `result` validates, `mod.rs` wraps.

pub use opbridge_plugin_sdk::sys::*;
