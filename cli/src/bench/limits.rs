//! `kvtier bench limits`: what this machine can do at best, measured in the
//! same run as the figures compared against it.
//!
//! - cold memcpy: copies of each chunk size rotating through a source and a
//!   destination pool of `--pool` bytes each (≥ 1 GiB, so caches do not
//!   help), median of 3 sweeps;
//! - O_DIRECT sequential write (fdatasync at the end, included) and read of
//!   `--disk-bytes` in the scratch dir's filesystem with the same block
//!   sizes, queue depth 1 (buffered I/O when the filesystem refuses
//!   O_DIRECT, and the table says so);
//! - one TCP loopback stream;
//! - one raw QUIC stream on loopback with the peer transport's own settings
//!   (`peer::TransportTuning::loopback`) and mutual TLS, the baseline of
//!   peer fetches.

use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use serde::Serialize;

use super::report::{Report, Table, f2, print_header};
use super::{CHUNK_SIZES, CommonArgs, Scratch, bar, gbps, parse_size, size_name};
use crate::EXIT_OK;

/// `kvtier bench limits`
#[derive(Debug, Args, Clone)]
pub struct LimitsArgs {
    /// Chunk / block sizes.
    #[arg(long, value_delimiter = ',', value_parser = parse_size, default_value = "256KiB,1MiB,2.5MiB,4MiB")]
    pub sizes: Vec<u64>,
    /// Each memcpy pool (source and destination) in bytes; at least 1GiB for
    /// a cold copy.
    #[arg(long, value_parser = crate::bench::parse_bytes, default_value = "1GiB")]
    pub pool: node::ByteSize,
    /// Bytes written and read per block size with O_DIRECT.
    #[arg(long, value_parser = crate::bench::parse_bytes, default_value = "512MiB")]
    pub disk_bytes: node::ByteSize,
    /// Bytes sent over TCP and QUIC loopback.
    #[arg(long, value_parser = crate::bench::parse_bytes, default_value = "512MiB")]
    pub net_bytes: node::ByteSize,
    /// Common options.
    #[command(flatten)]
    pub common: CommonArgs,
}

impl Default for LimitsArgs {
    fn default() -> Self {
        Self {
            sizes: CHUNK_SIZES.to_vec(),
            pool: node::ByteSize::gib(1),
            disk_bytes: node::ByteSize::mib(512),
            net_bytes: node::ByteSize::mib(512),
            common: CommonArgs::default(),
        }
    }
}

/// One size's limits.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct SizeLimits {
    pub size: u64,
    pub memcpy_cold_gbps: f64,
    pub direct_write_gbps: f64,
    pub direct_read_gbps: f64,
}

/// Everything `limits` measures.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Limits {
    pub sizes: Vec<SizeLimits>,
    /// Whether the disk figures are O_DIRECT (false: buffered fallback).
    pub direct_io: bool,
    pub tcp_gbps: f64,
    /// Raw quinn with the peer transport's settings (`TransportTuning::loopback`).
    pub quic_gbps: Option<f64>,
    /// Raw quinn with quinn's default transport settings.
    pub quic_default_gbps: Option<f64>,
    pub quic_error: Option<String>,
}

impl Limits {
    pub(crate) fn at(&self, size: u64) -> Option<&SizeLimits> {
        self.sizes.iter().find(|s| s.size == size)
    }
}

/// Free space a disk measurement leaves on its filesystem.
const DISK_MARGIN: u64 = 1 << 30;

/// Bytes an unprivileged writer may still allocate on `dir`'s filesystem.
fn free_space(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs is plain data; all zeroes is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a valid out-parameter; statvfs(3)
    // only writes it.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(st.f_bavail.saturating_mul(st.f_frsize.max(1)))
}

/// Measures the memcpy and disk limits for `sizes` (and the network ones
/// when `net` is set) in `dir`.
pub(crate) fn measure(args: &LimitsArgs, dir: &Path, net: bool) -> Result<Limits> {
    let largest = args.sizes.iter().copied().max().unwrap_or(0);
    for (flag, have) in [("--pool", args.pool), ("--disk-bytes", args.disk_bytes)] {
        if have.0 < largest {
            anyhow::bail!(
                "{flag} {have} is smaller than the largest of --sizes ({}): it must hold one chunk at least",
                node::ByteSize(largest)
            );
        }
    }
    // Checked before any work (QA: a 100 TiB pool aborted on its
    // allocation, a 100 TiB disk run filled the filesystem).
    if let Some(avail) = super::report::meminfo("MemAvailable")
        && args.pool.0 > avail
    {
        anyhow::bail!(
            "--pool {} is more than the memory available here ({})",
            args.pool,
            node::ByteSize(avail).approx()
        );
    }
    if let Some(free) = free_space(dir)
        && args.disk_bytes.0.saturating_add(DISK_MARGIN) > free
    {
        anyhow::bail!(
            "--disk-bytes {} does not fit the free space of {} ({}, keeping {} free)",
            args.disk_bytes,
            dir.display(),
            node::ByteSize(free).approx(),
            node::ByteSize(DISK_MARGIN)
        );
    }
    let steps = args.sizes.len() as u64 * 2 + if net { 2 } else { 0 };
    let pb = bar(steps, "limits");
    let mut sizes = Vec::new();
    let mut direct_io = true;
    let mut pool = Pools::new(args.pool.0 as usize);
    for &size in &args.sizes {
        pb.set_message(format!("memcpy {}", size_name(size)));
        let memcpy = pool.memcpy_cold(size as usize);
        pb.inc(1);
        pb.set_message(format!("O_DIRECT {}", size_name(size)));
        let (w, r, direct) = direct_rw(dir, size as usize, args.disk_bytes.0)?;
        direct_io &= direct;
        pb.inc(1);
        sizes.push(SizeLimits {
            size,
            memcpy_cold_gbps: memcpy,
            direct_write_gbps: w,
            direct_read_gbps: r,
        });
    }
    drop(pool);
    let (mut tcp, mut quic, mut quic_default, mut quic_error) = (f64::NAN, None, None, None);
    if net {
        pb.set_message("TCP loopback");
        tcp = tcp_loopback(args.net_bytes.0)?;
        pb.inc(1);
        pb.set_message("QUIC loopback");
        match quic_loopback(args.net_bytes.0, QuicSettings::Peer) {
            Ok(q) => quic = Some(q),
            Err(e) => quic_error = Some(format!("{e:#}")),
        }
        match quic_loopback(args.net_bytes.0, QuicSettings::QuinnDefault) {
            Ok(q) => quic_default = Some(q),
            Err(e) => quic_error = Some(format!("{e:#}")),
        }
        pb.inc(1);
    }
    pb.finish_and_clear();
    Ok(Limits {
        sizes,
        direct_io,
        tcp_gbps: tcp,
        quic_gbps: quic,
        quic_default_gbps: quic_default,
        quic_error,
    })
}

/// Runs `kvtier bench limits`.
pub(crate) fn run(args: &LimitsArgs) -> Result<u8> {
    print_header("limits")?;
    let scratch = Scratch::new(args.common.dir.as_deref(), "limits")?;
    let l = measure(args, scratch.path(), true)?;
    print_limits(&l)?;
    let mut report = Report::new("limits");
    report.set("limits", serde_json::to_value(&l)?);
    report.write(args.common.json.as_deref())?;
    Ok(EXIT_OK)
}

pub(crate) fn print_limits(l: &Limits) -> anyhow::Result<()> {
    let io = if l.direct_io {
        "O_DIRECT"
    } else {
        "buffered (no O_DIRECT)"
    };
    let mut t = Table::new(
        &format!("machine limits (GB/s; disk: {io}, sequential, qd1)"),
        &["size", "memcpy cold", "disk write", "disk read"],
    );
    for s in &l.sizes {
        t.row(vec![
            size_name(s.size),
            f2(s.memcpy_cold_gbps),
            f2(s.direct_write_gbps),
            f2(s.direct_read_gbps),
        ]);
    }
    t.print()?;
    if l.tcp_gbps.is_finite() {
        outln!("TCP loopback, one stream:  {} GB/s", f2(l.tcp_gbps));
        match (&l.quic_gbps, &l.quic_error) {
            (Some(q), _) => outln!(
                "QUIC loopback, one stream (quinn, peer transport settings, mTLS): {} GB/s",
                f2(*q)
            ),
            (None, Some(e)) => outln!("QUIC loopback: not measured: {e}"),
            (None, None) => {}
        }
        if let Some(q) = l.quic_default_gbps {
            outln!(
                "QUIC loopback, one stream (quinn, quinn's default transport settings, mTLS): {} GB/s",
                f2(q)
            );
        }
    }
    Ok(())
}

/// Source and destination pools for the cold copy.
struct Pools {
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl Pools {
    fn new(len: usize) -> Self {
        // Written once so every page is faulted in before timing.
        let mut src = vec![0u8; len];
        for (i, b) in src.iter_mut().enumerate().step_by(4096) {
            *b = i as u8 | 1;
        }
        let mut dst = vec![0u8; len];
        for b in dst.iter_mut().step_by(4096) {
            *b = 1;
        }
        Self { src, dst }
    }

    /// Median GB/s of 3 sweeps copying `size`-byte blocks through the pools
    /// (destination slots rotate in a different order from the source's).
    fn memcpy_cold(&mut self, size: usize) -> f64 {
        let slots = (self.src.len() / size).max(1);
        // A step prime to the slot count, so that every destination slot is
        // written (7 alone left some out when it divided the count: audit).
        let gcd = |mut a: usize, mut b: usize| {
            while b != 0 {
                (a, b) = (b, a % b);
            }
            a
        };
        let step = [7, 11, 13, 17, 19, 23, 29, 31]
            .into_iter()
            .find(|&p| gcd(p, slots) == 1)
            .unwrap_or(1);
        let mut runs = Vec::new();
        for _ in 0..3 {
            let t0 = Instant::now();
            for i in 0..slots {
                let j = (i * step + 3) % slots;
                self.dst[j * size..(j + 1) * size]
                    .copy_from_slice(&self.src[i * size..(i + 1) * size]);
            }
            runs.push(gbps((slots * size) as u64, t0.elapsed()));
            std::hint::black_box(&self.dst);
        }
        runs.sort_by(f64::total_cmp);
        runs[1]
    }
}

/// An aligned block inside a Vec (for O_DIRECT).
fn aligned(buf: &mut [u8], len: usize) -> &mut [u8] {
    let off = buf.as_ptr().align_offset(4096);
    &mut buf[off..off + len]
}

/// Sequential write (+ fdatasync) and read of `total` bytes in `size`
/// blocks; returns (write GB/s, read GB/s, O_DIRECT used).
fn direct_rw(dir: &Path, size: usize, total: u64) -> Result<(f64, f64, bool)> {
    let path = dir.join("limits-direct.bin");
    let _ = std::fs::remove_file(&path);
    let blocks = (total / size as u64).max(1);
    let open = |direct: bool, write: bool| {
        let mut o = std::fs::OpenOptions::new();
        o.read(true);
        if write {
            o.write(true).create(true);
        }
        if direct {
            o.custom_flags(libc::O_DIRECT);
        }
        o.open(&path)
    };
    let mut buf = vec![0u8; size + 4096];
    let block = aligned(&mut buf, size);
    for (i, b) in block.iter_mut().enumerate() {
        *b = (i * 31 + 7) as u8;
    }
    let (f, direct) = match open(true, true) {
        Ok(f) => (f, true),
        Err(_) => (
            open(false, true).with_context(|| format!("create {}", path.display()))?,
            false,
        ),
    };
    let write = |f: &std::fs::File| -> std::io::Result<Duration> {
        let t0 = Instant::now();
        for i in 0..blocks {
            f.write_all_at(block, i * size as u64)?;
        }
        f.sync_data()?;
        Ok(t0.elapsed())
    };
    let (f, direct, wt) = match write(&f) {
        Ok(t) => (f, direct, t),
        // Some filesystems accept O_DIRECT at open and refuse the write.
        Err(_) if direct => {
            drop(f);
            let f = open(false, true).with_context(|| format!("open {}", path.display()))?;
            let t = write(&f).with_context(|| format!("write {}", path.display()))?;
            (f, false, t)
        }
        Err(e) => return Err(e).with_context(|| format!("write {}", path.display())),
    };
    drop(f);
    let f = open(direct, false).with_context(|| format!("open {}", path.display()))?;
    let t0 = Instant::now();
    for i in 0..blocks {
        f.read_exact_at(block, i * size as u64)
            .with_context(|| format!("read {}", path.display()))?;
    }
    let rt = t0.elapsed();
    drop(f);
    let _ = std::fs::remove_file(&path);
    let bytes = blocks * size as u64;
    Ok((gbps(bytes, wt), gbps(bytes, rt), direct))
}

/// One TCP stream on 127.0.0.1: `total` bytes in 1 MiB writes; timed until
/// the receiver has read them all.
pub(crate) fn tcp_loopback(total: u64) -> Result<f64> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("bind TCP loopback")?;
    let addr = l.local_addr()?;
    let rx = std::thread::spawn(move || -> std::io::Result<Instant> {
        let (mut s, _) = l.accept()?;
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0u64;
        while got < total {
            let n = s.read(&mut buf)?;
            if n == 0 {
                break;
            }
            got += n as u64;
        }
        s.write_all(b"k")?;
        Ok(Instant::now())
    });
    let mut s = std::net::TcpStream::connect(addr).context("connect TCP loopback")?;
    let buf = vec![7u8; 1 << 20];
    let t0 = Instant::now();
    let mut sent = 0u64;
    while sent < total {
        let n = (total - sent).min(buf.len() as u64) as usize;
        s.write_all(&buf[..n])?;
        sent += n as u64;
    }
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack)?;
    let end = rx
        .join()
        .map_err(|_| anyhow::anyhow!("TCP receiver panicked"))??;
    Ok(gbps(total, end - t0))
}

/// Which QUIC transport settings a raw quinn measurement uses.
#[derive(Clone, Copy, Debug)]
pub(crate) enum QuicSettings {
    /// The peer transport's own (`peer::TransportTuning::loopback`).
    Peer,
    /// quinn's defaults (endpoint, transport, kernel socket buffers).
    QuinnDefault,
}

/// One raw quinn stream on 127.0.0.1 with the given settings and mutual
/// TLS from a throwaway CA.
pub(crate) fn quic_loopback(total: u64, settings: QuicSettings) -> Result<f64> {
    use node::peer::TransportTuning;
    use node::peer::cert::{self, Validity};
    use node::peer::tls::TlsSetup;
    use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};

    let ca = cert::init_ca("bench", Validity::days(1)).context("create a CA")?;
    let tls = |n: &str| -> Result<TlsSetup> {
        Ok(TlsSetup::from_material(
            &cert::issue(&ca, n, &[], &[], Validity::days(1)).context("issue a certificate")?,
        )?)
    };
    let (ta, tb) = (tls("bench-a")?, tls("bench-b")?);
    let t = TransportTuning::loopback();
    let peer = matches!(settings, QuicSettings::Peer);
    let pc = node::peer::PeerConfig::default();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("start a runtime")?;
    let run = async move {
        let transport = Arc::new(if peer {
            t.transport_config(pc.keep_alive, Duration::from_secs(30))
        } else {
            quinn::TransportConfig::default()
        });
        let endpoint_config = || {
            if peer {
                t.endpoint_config()
            } else {
                quinn::EndpointConfig::default()
            }
        };
        let bind = || -> std::io::Result<std::net::UdpSocket> {
            let addr = "127.0.0.1:0".parse().expect("address");
            if peer {
                t.bind_socket(addr)
            } else {
                std::net::UdpSocket::bind(addr)
            }
        };
        let mut sc = quinn::ServerConfig::with_crypto(Arc::new(
            QuicServerConfig::try_from(ta.server.clone()).context("QUIC server config")?,
        ));
        sc.transport_config(transport.clone());
        let server = quinn::Endpoint::new(
            endpoint_config(),
            Some(sc),
            bind()?,
            quinn::default_runtime().context("quinn runtime")?,
        )?;
        let mut cc = quinn::ClientConfig::new(Arc::new(
            QuicClientConfig::try_from(tb.client.clone()).context("QUIC client config")?,
        ));
        cc.transport_config(transport);
        let client = quinn::Endpoint::new(
            endpoint_config(),
            None,
            bind()?,
            quinn::default_runtime().context("quinn runtime")?,
        )?;
        let srv = server.clone();
        let receiver = tokio::spawn(async move {
            let conn = srv.accept().await.context("no connection")?.await?;
            let (mut send, mut recv) = conn.accept_bi().await?;
            let mut got = 0u64;
            while let Some(c) = recv.read_chunk(1 << 20, true).await? {
                got += c.bytes.len() as u64;
            }
            send.write_all(b"k").await?;
            send.finish()?;
            // Keep the connection until the client has read the ack.
            let _ = conn.closed().await;
            anyhow::Ok(got)
        });
        let conn = client
            .connect_with(cc, server.local_addr()?, "bench-a")?
            .await
            .context("QUIC handshake")?;
        let (mut send, mut recv) = conn.open_bi().await?;
        let block = bytes::Bytes::from(vec![7u8; 1 << 20]);
        let t0 = Instant::now();
        let mut sent = 0u64;
        while sent < total {
            let n = (total - sent).min(block.len() as u64) as usize;
            send.write_chunk(block.slice(..n)).await?;
            sent += n as u64;
        }
        send.finish()?;
        let mut ack = [0u8; 1];
        recv.read_exact(&mut ack).await?;
        let elapsed = t0.elapsed();
        conn.close(0u32.into(), b"done");
        let got = receiver.await.context("join the QUIC receiver")??;
        anyhow::ensure!(got == total, "QUIC receiver got {got} of {total} bytes");
        client.wait_idle().await;
        Ok(gbps(total, elapsed))
    };
    rt.block_on(async move {
        tokio::time::timeout(QUIC_DEADLINE, run)
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "the QUIC transfer of {total} bytes took longer than {QUIC_DEADLINE:?}"
                )
            })?
    })
}

/// Longest a QUIC loopback measurement may run.
const QUIC_DEADLINE: Duration = Duration::from_secs(60);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn direct_rw_measures_a_small_file() {
        let dir = Scratch::new(None, "limits-test").unwrap();
        let (w, r, _) = direct_rw(dir.path(), 1 << 20, 4 << 20).unwrap();
        assert!(w > 0.0 && r > 0.0);
    }

    #[test]
    fn loopback_streams_deliver_every_byte() {
        assert!(tcp_loopback(8 << 20).unwrap() > 0.0);
        assert!(quic_loopback(8 << 20, QuicSettings::Peer).unwrap() > 0.0);
        assert!(quic_loopback(8 << 20, QuicSettings::QuinnDefault).unwrap() > 0.0);
    }
}
