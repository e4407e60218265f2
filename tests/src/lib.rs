//! Helpers for multi-process tests that start real `kvtier` daemons.
