//! Shared harness of the native-protocol tests: a real server on a Unix
//! socket in a temp dir, driven by a runtime on its own thread.

#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use node::NodeContext;
use node::native::{self, Client, NativeError, NativeOptions};
use node::tier::{ChunkKey, ChunkStore, NamespaceRecord, TierConfig};

/// A running native server over a fresh store.
pub struct TestServer {
    /// Holds the socket and the store's files.
    pub dir: tempfile::TempDir,
    /// The socket path.
    pub path: PathBuf,
    /// The context the server serves.
    pub ctx: Arc<NodeContext>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<Result<(), NativeError>>>,
}

impl TestServer {
    pub fn start() -> Self {
        Self::start_with(NativeOptions::default())
    }

    pub fn start_with(opts: NativeOptions) -> Self {
        Self::start_with_ram(opts, 256 << 20)
    }

    /// A server whose store has `ram_budget` bytes of RAM (64 MiB of disk).
    pub fn start_with_ram(opts: NativeOptions, ram_budget: u64) -> Self {
        Self::start_with_config(opts, |c| c.ram_budget = ram_budget)
    }

    /// A server over a store of 256 MiB of RAM and 64 MiB of disk, as
    /// `tune` leaves that configuration.
    pub fn start_with_config(opts: NativeOptions, tune: impl FnOnce(&mut TierConfig)) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut config = TierConfig {
            data_dir: dir.path().join("data"),
            ram_budget: 256 << 20,
            disk_budget: 64 << 20,
            region_size: 8 << 20,
            ..TierConfig::default()
        };
        tune(&mut config);
        let store = Arc::new(ChunkStore::open(config).expect("open store"));
        let ctx = Arc::new(NodeContext::new(store, "test-node".into()));
        let path = dir.path().join("s.sock");
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = {
            let ctx = Arc::clone(&ctx);
            let path = path.clone();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .expect("runtime");
                rt.block_on(async move {
                    let listener = native::bind(&path, native::DEFAULT_SOCKET_MODE)?;
                    ready_tx.send(()).expect("test alive");
                    native::serve(listener, ctx, opts, async {
                        let _ = stop_rx.await;
                    })
                    .await
                })
            })
        };
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("server bound its socket");
        Self {
            dir,
            path,
            ctx,
            stop: Some(stop_tx),
            thread: Some(thread),
        }
    }

    pub fn client(&self) -> Client {
        let c = Client::connect(&self.path).expect("connect");
        c.set_timeout(Some(Duration::from_secs(20)))
            .expect("timeout");
        c
    }

    /// Stops the server and waits (bounded) for `serve` to return.
    pub fn stop(mut self) -> Result<(), NativeError> {
        self.stop_inner()
    }

    fn stop_inner(&mut self) -> Result<(), NativeError> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let Some(t) = self.thread.take() else {
            return Ok(());
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !t.is_finished() {
            assert!(Instant::now() < deadline, "server did not stop within 20 s");
            std::thread::sleep(Duration::from_millis(5));
        }
        t.join().expect("server thread")
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = self.stop_inner();
        }
    }
}

pub fn record(rank: u32) -> NamespaceRecord {
    NamespaceRecord {
        model: "test-model".into(),
        engine: "test".into(),
        // Ranks past 1 are distinct namespaces in tests; a rank is below tp-size.
        tp_size: 2.max(rank + 1),
        rank,
        kv_dtype: "bfloat16".into(),
        block_size: 16,
        chunk_tokens: 256,
        hash_algo: "sha256_cbor".into(),
        ..Default::default()
    }
}

pub fn key(i: u32) -> ChunkKey {
    let mut k = [0u8; 32];
    k[..4].copy_from_slice(&i.to_le_bytes());
    k[31] = 0xAB;
    ChunkKey(k)
}

/// Deterministic, key-dependent payload bytes.
pub fn payload(i: u32, len: usize) -> Vec<u8> {
    let mut x = u64::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Polls `f` until it returns true, for at most `secs` seconds.
pub fn wait_until(secs: u64, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    false
}
