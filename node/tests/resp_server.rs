//! The RESP endpoint over real TCP on 127.0.0.1, against a real chunk
//! store: every reply is compared byte for byte with what Redis 7 sends.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use node::NodeContext;
use node::resp::{self, RespOptions};
use tier::{ChunkStore, TierConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

const T: Duration = Duration::from_secs(10);

struct Server {
    addr: SocketAddr,
    ctx: Arc<NodeContext>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), resp::RespError>>>,
    _dir: tempfile::TempDir,
}

impl Server {
    async fn start(opts: RespOptions) -> Self {
        Self::start_with(opts, |c| c).await
    }

    /// A server over a store configured by `tier` (RAM only by default).
    async fn start_with(opts: RespOptions, tier: impl FnOnce(TierConfig) -> TierConfig) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = tier(TierConfig {
            data_dir: dir.path().to_path_buf(),
            ram_budget: 256 << 20,
            disk_budget: 0,
            ..TierConfig::default()
        });
        let store = Arc::new(ChunkStore::open(cfg).expect("open store"));
        let ctx = Arc::new(NodeContext::new(store, "test-node".into()));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(resp::serve(listener, Arc::clone(&ctx), opts, async {
            let _ = rx.await;
        }));
        Self {
            addr,
            ctx,
            stop: Some(tx),
            task: Some(task),
            _dir: dir,
        }
    }

    async fn connect(&self) -> TcpStream {
        tokio::time::timeout(T, TcpStream::connect(self.addr))
            .await
            .expect("connect in time")
            .expect("connect")
    }

    async fn stop(mut self) {
        let _ = self.stop.take().expect("running").send(());
        let task = self.task.take().expect("running");
        tokio::time::timeout(T, task)
            .await
            .expect("serve returns after shutdown")
            .expect("join")
            .expect("serve ok");
    }
}

/// Sends `req` and asserts the reply is exactly `want`.
async fn rt(c: &mut TcpStream, req: &[u8], want: &[u8]) {
    c.write_all(req).await.expect("write");
    expect(c, want).await;
}

async fn expect(c: &mut TcpStream, want: &[u8]) {
    let mut got = vec![0u8; want.len()];
    tokio::time::timeout(T, c.read_exact(&mut got))
        .await
        .unwrap_or_else(|_| panic!("reply in time; wanted {:?}", String::from_utf8_lossy(want)))
        .unwrap_or_else(|e| panic!("read: {e}; wanted {:?}", String::from_utf8_lossy(want)));
    assert_eq!(
        String::from_utf8_lossy(&got),
        String::from_utf8_lossy(want),
        "reply bytes differ"
    );
    assert_eq!(got, want);
}

async fn expect_eof(c: &mut TcpStream) {
    let mut b = [0u8; 64];
    let n = tokio::time::timeout(T, c.read(&mut b))
        .await
        .expect("EOF in time")
        .unwrap_or(0);
    assert_eq!(n, 0, "expected the server to close, got {:?}", &b[..n]);
}

fn cmd(args: &[&[u8]]) -> Vec<u8> {
    let mut v = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        v.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        v.extend_from_slice(a);
        v.extend_from_slice(b"\r\n");
    }
    v
}

fn bulk(b: &[u8]) -> Vec<u8> {
    let mut v = format!("${}\r\n", b.len()).into_bytes();
    v.extend_from_slice(b);
    v.extend_from_slice(b"\r\n");
    v
}

#[tokio::test]
async fn basic_commands_reply_like_redis() {
    let s = Server::start(RespOptions::default()).await;
    let mut c = s.connect().await;
    rt(&mut c, b"PING\r\n", b"+PONG\r\n").await;
    rt(&mut c, &cmd(&[b"ping", b"hello"]), b"$5\r\nhello\r\n").await;
    // redis-cli --pipe ends with an ECHO of a random marker.
    rt(&mut c, &cmd(&[b"ECHO", b"a\r\nb"]), b"$4\r\na\r\nb\r\n").await;
    rt(
        &mut c,
        b"ECHO\r\n",
        b"-ERR wrong number of arguments for 'echo' command\r\n",
    )
    .await;
    rt(
        &mut c,
        b"PING a b\r\n",
        b"-ERR wrong number of arguments for 'ping' command\r\n",
    )
    .await;
    rt(
        &mut c,
        b"FOO a b\r\n",
        b"-ERR unknown command 'FOO', with args beginning with: 'a' 'b' \r\n",
    )
    .await;
    rt(
        &mut c,
        b"foo\r\n",
        b"-ERR unknown command 'foo', with args beginning with: \r\n",
    )
    .await;
    rt(
        &mut c,
        b"GET\r\n",
        b"-ERR wrong number of arguments for 'get' command\r\n",
    )
    .await;
    rt(
        &mut c,
        b"get a b\r\n",
        b"-ERR wrong number of arguments for 'get' command\r\n",
    )
    .await;
    rt(
        &mut c,
        b"EXISTS\r\n",
        b"-ERR wrong number of arguments for 'exists' command\r\n",
    )
    .await;
    rt(
        &mut c,
        b"DBSIZE x\r\n",
        b"-ERR wrong number of arguments for 'dbsize' command\r\n",
    )
    .await;
    rt(&mut c, b"DBSIZE\r\n", b":0\r\n").await;
    rt(
        &mut c,
        b"SET k v\r\nGET k\r\nEXISTS k k nokey\r\nDBSIZE\r\nDEL k nokey\r\nGET k\r\nDBSIZE\r\n",
        b"+OK\r\n$1\r\nv\r\n:2\r\n:1\r\n:1\r\n$-1\r\n:0\r\n",
    )
    .await;
    rt(&mut c, b"SET k v BOGUS\r\n", b"-ERR syntax error\r\n").await;
    rt(&mut c, b"SET k v NX XX\r\n", b"-ERR syntax error\r\n").await;
    rt(
        &mut c,
        b"SET k v NX\r\nSET k v NX\r\nSET k w XX GET\r\nGET k\r\nDEL k\r\nSET k v XX\r\n",
        b"+OK\r\n$-1\r\n$1\r\nv\r\n$1\r\nw\r\n:1\r\n$-1\r\n",
    )
    .await;
    rt(
        &mut c,
        b"SET k v EX 10\r\n",
        b"-ERR SET option 'EX' is not supported by kvtier: keys do not expire (the cache evicts by size)\r\n",
    )
    .await;
    // Redis checks every option first, then the expiry's value (QA: these
    // got the "not supported" error).
    rt(
        &mut c,
        b"SET k v KEEPTTL EX 5\r\nSET k v EX 5 KEEPTTL\r\nSET k v EX 5 PX 5\r\nSET k v EX abc\r\nSET k v EX 0\r\nSET k v EX\r\n",
        b"-ERR syntax error\r\n-ERR syntax error\r\n-ERR syntax error\r\n-ERR value is not an integer or out of range\r\n-ERR invalid expire time in 'set' command\r\n-ERR syntax error\r\n",
    )
    .await;
    // The same expiry option twice: the last one counts, as in Redis 7.0
    // (QA: a syntax error here).
    rt(
        &mut c,
        b"SET k v EX 5 EX 0\r\nSET k v px 5 PX 7\r\nSET k v EX 5 EX\r\n",
        b"-ERR invalid expire time in 'set' command\r\n-ERR SET option 'PX' is not supported by kvtier: keys do not expire (the cache evicts by size)\r\n-ERR syntax error\r\n",
    )
    .await;
    rt(
        &mut c,
        b"SELECT 0\r\nSELECT 1\r\nSELECT x\r\nSELECT 99999999999\r\n",
        b"+OK\r\n-ERR DB index is out of range\r\n-ERR value is not an integer or out of range\r\n-ERR value is out of range, value must between -2147483648 and 2147483647\r\n",
    )
    .await;
    rt(
        &mut c,
        b"CLIENT NO-EVICT on\r\nCLIENT NO-EVICT maybe\r\nCLIENT NO-EVICT on x\r\nCLIENT NO-TOUCH OFF\r\nCLIENT SETINFO LIB-VER 1\r\nCLIENT SETINFO badattr x\r\nCLIENT SETINFO LIB-NAME\r\n",
        b"+OK\r\n-ERR syntax error\r\n-ERR wrong number of arguments for 'client|no-evict' command\r\n+OK\r\n+OK\r\n-ERR Unrecognized option 'badattr'\r\n-ERR wrong number of arguments for 'client|setinfo' command\r\n",
    )
    .await;
    rt(
        &mut c,
        b"HELLO 4\r\n",
        b"-NOPROTO unsupported protocol version\r\n",
    )
    .await;
    rt(
        &mut c,
        b"HELLO x\r\n",
        b"-ERR Protocol version is not an integer or out of range\r\n",
    )
    .await;
    rt(
        &mut c,
        b"HELLO 2 BOGUS\r\n",
        b"-ERR Syntax error in HELLO option 'BOGUS'\r\n",
    )
    .await;
    rt(
        &mut c,
        b"HELLO 2 SETNAME \"a b\"\r\n",
        b"-ERR Client names cannot contain spaces, newlines or special characters.\r\n",
    )
    .await;
    rt(
        &mut c,
        b"HELLO 2 SETNAME n\r\n",
        b"*14\r\n$6\r\nserver\r\n$5\r\nredis\r\n$7\r\nversion\r\n$5\r\n7.2.0\r\n$5\r\nproto\r\n:2\r\n$2\r\nid\r\n:1\r\n$4\r\nmode\r\n$10\r\nstandalone\r\n$4\r\nrole\r\n$6\r\nmaster\r\n$7\r\nmodules\r\n*0\r\n",
    )
    .await;
    rt(
        &mut c,
        b"CLIENT GETNAME\r\nCLIENT SETNAME foo\r\nCLIENT GETNAME\r\nCLIENT SETINFO LIB-NAME x\r\nCLIENT ID\r\nCLIENT\r\nCLIENT SETNAME\r\n",
        b"$1\r\nn\r\n+OK\r\n$3\r\nfoo\r\n+OK\r\n:1\r\n-ERR wrong number of arguments for 'client' command\r\n-ERR wrong number of arguments for 'client|setname' command\r\n",
    )
    .await;
    rt(
        &mut c,
        b"CLIENT TRACKING ON\r\nCLIENT TRACKING off\r\n",
        b"-ERR CLIENT TRACKING is not supported by kvtier (no invalidation messages); keep client-side caching off\r\n+OK\r\n",
    )
    .await;
    rt(
        &mut c,
        b"CONFIG HELP\r\n",
        b"*3\r\n+CONFIG <subcommand> [<arg> ...]. kvtier serves:\r\n+GET <pattern> [<pattern> ...]\r\n+SET, RESETSTAT, REWRITE: refused (kvtier is configured by its file)\r\n",
    )
    .await;
    rt(
        &mut c,
        b"CLIENT HELP\r\n",
        b"*5\r\n+CLIENT <subcommand> [<arg> ...]. kvtier serves:\r\n+ID\r\n+GETNAME\r\n+SETNAME <name>\r\n+SETINFO, NO-EVICT, NO-TOUCH, TRACKING OFF: accepted and ignored\r\n",
    )
    .await;
    // Hints are accepted; what kvtier does not do is refused, not "+OK".
    rt(
        &mut c,
        b"CLIENT NO-EVICT on\r\nCLIENT no-touch\r\nCLIENT KILL ID 1\r\nCLIENT PAUSE 100\r\n",
        b"+OK\r\n-ERR wrong number of arguments for 'client|no-touch' command\r\n-ERR unknown subcommand 'KILL'. Try CLIENT HELP.\r\n-ERR unknown subcommand 'PAUSE'. Try CLIENT HELP.\r\n",
    )
    .await;
    rt(
        &mut c,
        b"AUTH pw\r\n",
        b"-ERR AUTH <password> called without any password configured for the default user. Are you sure your configuration is correct?\r\n",
    )
    .await;
    rt(&mut c, b"AUTH default pw\r\n", b"+OK\r\n").await;
    rt(&mut c, b"AUTH a b c\r\n", b"-ERR syntax error\r\n").await;
    rt(
        &mut c,
        b"AUTH bob pw\r\n",
        b"-WRONGPASS invalid username-password pair or user is disabled.\r\n",
    )
    .await;
    rt(&mut c, b"COMMAND COUNT\r\n", b":15\r\n").await;
    rt(&mut c, b"COMMAND DOCS\r\n", b"*0\r\n").await;
    // Redis 7's entry shape: name, arity, flags, first/last key and step,
    // ACL categories, then empty tips, key specs and subcommands; a null
    // entry for a command not served.
    rt(
        &mut c,
        b"COMMAND INFO GET nope del\r\n",
        b"*3\r\n\
          *10\r\n$3\r\nget\r\n:2\r\n*2\r\n+readonly\r\n+fast\r\n:1\r\n:1\r\n:1\r\n\
          *3\r\n+@read\r\n+@string\r\n+@fast\r\n*0\r\n*0\r\n*0\r\n\
          *-1\r\n\
          *10\r\n$3\r\ndel\r\n:-2\r\n*1\r\n+write\r\n:1\r\n:-1\r\n:1\r\n\
          *3\r\n+@keyspace\r\n+@write\r\n+@slow\r\n*0\r\n*0\r\n*0\r\n",
    )
    .await;
    rt(
        &mut c,
        b"COMMAND LIST\r\n",
        b"*15\r\n$4\r\nauth\r\n$6\r\nclient\r\n$7\r\ncommand\r\n$6\r\nconfig\r\n\
          $6\r\ndbsize\r\n$3\r\ndel\r\n$4\r\necho\r\n$6\r\nexists\r\n$3\r\nget\r\n$5\r\nhello\r\n\
          $4\r\ninfo\r\n$4\r\nping\r\n$4\r\nquit\r\n$6\r\nselect\r\n$3\r\nset\r\n",
    )
    .await;
    // Redis 7's filters: by pattern (any case), by ACL category (without
    // its `@`), by module (none are loaded); anything else is a syntax
    // error, and COUNT takes no arguments.
    rt(
        &mut c,
        b"COMMAND LIST FILTERBY PATTERN C*\r\n",
        b"*3\r\n$6\r\nclient\r\n$7\r\ncommand\r\n$6\r\nconfig\r\n",
    )
    .await;
    rt(
        &mut c,
        b"command list filterby aclcat KEYSPACE\r\n",
        b"*3\r\n$6\r\ndbsize\r\n$3\r\ndel\r\n$6\r\nexists\r\n",
    )
    .await;
    rt(&mut c, b"COMMAND LIST FILTERBY ACLCAT nope\r\n", b"*0\r\n").await;
    rt(&mut c, b"COMMAND LIST FILTERBY MODULE x\r\n", b"*0\r\n").await;
    rt(
        &mut c,
        b"COMMAND LIST FILTERBY NAME x\r\n",
        b"-ERR syntax error\r\n",
    )
    .await;
    rt(&mut c, b"COMMAND LIST x\r\n", b"-ERR syntax error\r\n").await;
    rt(
        &mut c,
        b"COMMAND COUNT x\r\n",
        b"-ERR wrong number of arguments for 'command|count' command\r\n",
    )
    .await;
    rt(
        &mut c,
        b"COMMAND BOGUS\r\n",
        b"-ERR unknown subcommand 'BOGUS'. Try COMMAND HELP.\r\n",
    )
    .await;
    rt(
        &mut c,
        b"CONFIG GET save\r\n",
        b"*2\r\n$4\r\nsave\r\n$0\r\n\r\n",
    )
    .await;
    rt(
        &mut c,
        b"CONFIG GET appendonly\r\n",
        b"*2\r\n$10\r\nappendonly\r\n$2\r\nno\r\n",
    )
    .await;
    rt(&mut c, b"CONFIG GET nothing\r\n", b"*0\r\n").await;
    // Patterns, as redis-cli users type them; without `[*?` a name, as in
    // Redis 7 (an escape is then part of the name).
    rt(&mut c, b"CONFIG GET sav\\e\r\n", b"*0\r\n").await;
    rt(
        &mut c,
        b"CONFIG GET maxmemory-p*\r\n",
        b"*2\r\n$16\r\nmaxmemory-policy\r\n$11\r\nallkeys-lru\r\n",
    )
    .await;
    rt(
        &mut c,
        b"CONFIG GET app?ndonly s[a]ve\r\n",
        b"*4\r\n$4\r\nsave\r\n$0\r\n\r\n$10\r\nappendonly\r\n$2\r\nno\r\n",
    )
    .await;
    rt(
        &mut c,
        b"CONFIG GET\r\n",
        b"-ERR wrong number of arguments for 'config|get' command\r\n",
    )
    .await;
    rt(&mut c, b"*0\r\n*-1\r\n\r\nPING\r\n", b"+PONG\r\n").await;
    // A NUL ends an inline request (the C string Redis splits ends there).
    rt(&mut c, b"PING\x00junk \"\r\n", b"+PONG\r\n").await;
    rt(&mut c, b"INFO bogus\r\n", b"$0\r\n\r\n").await;
    rt(&mut c, b"INFO keyspace\r\n", b"$12\r\n# Keyspace\r\n\r\n").await;
    rt(&mut c, b"SET a b\r\n", b"+OK\r\n").await;
    rt(
        &mut c,
        b"INFO keyspace\r\n",
        b"$44\r\n# Keyspace\r\ndb0:keys=1,expires=0,avg_ttl=0\r\n\r\n",
    )
    .await;
    rt(&mut c, b"QUIT\r\nPING\r\n", b"+OK\r\n").await;
    expect_eof(&mut c).await;
    let errors = s
        .ctx
        .counters
        .resp_errors
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(errors >= 20, "errors are counted: {errors}");
    s.stop().await;
}

/// After `HELLO 3` replies are RESP3 as Redis 7 sends them (redis-py 5+
/// asks for RESP3 by default): HELLO's map, `_` nulls, CONFIG GET's map,
/// INFO as a verbatim string; `HELLO 2` switches back, and a failed HELLO
/// leaves the protocol as it was.
#[tokio::test]
async fn hello_3_switches_the_connection_to_resp3() {
    let s = Server::start(RespOptions::default()).await;
    let mut c = s.connect().await;
    let hello = |proto: u8| {
        format!(
            "{}\r\n$6\r\nserver\r\n$5\r\nredis\r\n$7\r\nversion\r\n$5\r\n7.2.0\r\n$5\r\nproto\r\n:{proto}\r\n$2\r\nid\r\n:1\r\n$4\r\nmode\r\n$10\r\nstandalone\r\n$4\r\nrole\r\n$6\r\nmaster\r\n$7\r\nmodules\r\n*0\r\n",
            if proto == 3 { "%7" } else { "*14" }
        )
        .into_bytes()
    };
    rt(&mut c, b"HELLO 3\r\n", &hello(3)).await;
    rt(
        &mut c,
        b"GET nope\r\nSET k v\r\nSET k w NX\r\nGET k\r\nCLIENT GETNAME\r\nDEL k\r\nSET k v XX GET\r\n",
        b"_\r\n+OK\r\n_\r\n$1\r\nv\r\n_\r\n:1\r\n_\r\n",
    )
    .await;
    rt(
        &mut c,
        b"CONFIG GET databases\r\nCOMMAND DOCS\r\nCOMMAND INFO nope ping\r\n",
        b"%1\r\n$9\r\ndatabases\r\n$1\r\n1\r\n%0\r\n*2\r\n_\r\n\
          *10\r\n$4\r\nping\r\n:-1\r\n~1\r\n+fast\r\n:0\r\n:0\r\n:0\r\n\
          ~2\r\n+@fast\r\n+@connection\r\n*0\r\n*0\r\n*0\r\n",
    )
    .await;
    c.write_all(b"INFO keyspace\r\n").await.expect("write");
    expect(&mut c, b"=16\r\ntxt:# Keyspace\r\n\r\n").await;
    // A HELLO that fails changes nothing; one without a version neither.
    rt(
        &mut c,
        b"HELLO 4\r\nGET nope\r\n",
        b"-NOPROTO unsupported protocol version\r\n_\r\n",
    )
    .await;
    rt(&mut c, b"HELLO\r\n", &hello(3)).await;
    rt(&mut c, b"HELLO 2\r\n", &hello(2)).await;
    rt(
        &mut c,
        b"GET nope\r\nCONFIG GET databases\r\nINFO keyspace\r\n",
        b"$-1\r\n*2\r\n$9\r\ndatabases\r\n$1\r\n1\r\n$12\r\n# Keyspace\r\n\r\n",
    )
    .await;
    s.stop().await;
}

#[tokio::test]
async fn info_has_redis_sections() {
    let s = Server::start(RespOptions::default()).await;
    // Connections of other interfaces (native, here two) are not Redis's
    // `total_connections_received` (they were counted in it).
    for _ in 0..2 {
        s.ctx
            .counters
            .connections
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    let mut c = s.connect().await;
    c.write_all(b"INFO\r\n").await.expect("write");
    let mut head = Vec::new();
    loop {
        let b = c.read_u8().await.expect("read");
        head.push(b);
        if head.ends_with(b"\r\n") {
            break;
        }
    }
    let len: usize = std::str::from_utf8(&head[1..head.len() - 2])
        .expect("utf8")
        .parse()
        .expect("bulk length");
    let mut body = vec![0u8; len + 2];
    c.read_exact(&mut body).await.expect("body");
    let text = String::from_utf8(body).expect("utf8");
    assert!(
        text.starts_with("# Server\r\nredis_version:7.2.0\r\n"),
        "{text}"
    );
    for needle in [
        "\r\n\r\n# Clients\r\nconnected_clients:1\r\n",
        "\r\n\r\n# Memory\r\nused_memory:0\r\n",
        "\r\n\r\n# Stats\r\ntotal_connections_received:1\r\n",
        &format!("tcp_port:{}\r\n", s.addr.port()),
        "\r\n\r\n# Keyspace\r\n",
    ] {
        assert!(text.contains(needle), "{needle:?} missing in {text}");
    }
    assert!(text.ends_with("# Keyspace\r\n\r\n"), "{text}");
    s.stop().await;
}

#[tokio::test]
async fn binary_keys_values_and_large_values_round_trip() {
    let s = Server::start(RespOptions::default()).await;
    let mut c = s.connect().await;
    let key: &[u8] = b"\xff\x00bin\r\nkey";
    let val: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
    rt(&mut c, &cmd(&[b"SET", key, &val]), b"+OK\r\n").await;
    rt(&mut c, &cmd(&[b"GET", key]), &bulk(&val)).await;
    rt(
        &mut c,
        &cmd(&[b"EXISTS", key, b"\xff\x00bin\r\nkeY"]),
        b":1\r\n",
    )
    .await;
    // 5 MiB: read directly into its own buffer, written back with a vectored write.
    let big: Vec<u8> = (0..5 * 1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 24) as u8)
        .collect();
    rt(&mut c, &cmd(&[b"SET", b"big", &big]), b"+OK\r\n").await;
    rt(&mut c, &cmd(&[b"GET", b"big"]), &bulk(&big)).await;
    // The same value sent one small piece at a time.
    let req = cmd(&[b"SET", b"big2", &big]);
    for piece in req.chunks(300_007) {
        c.write_all(piece).await.expect("write");
        tokio::task::yield_now().await;
    }
    expect(&mut c, b"+OK\r\n").await;
    rt(&mut c, &cmd(&[b"GET", b"big2"]), &bulk(&big)).await;
    // A new version of a large value lands in the buffer its old version
    // left in the store's pool (no fresh pages), with its own bytes.
    let pool = s.ctx.store.buffers();
    let reused = pool.stats().reused;
    let newer: Vec<u8> = big.iter().map(|b| b ^ 0x5a).collect();
    rt(&mut c, &cmd(&[b"SET", b"big", &newer]), b"+OK\r\n").await;
    rt(&mut c, &cmd(&[b"SET", b"big2", &newer]), b"+OK\r\n").await;
    assert!(pool.stats().reused > reused, "{:?}", pool.stats());
    rt(&mut c, &cmd(&[b"GET", b"big"]), &bulk(&newer)).await;
    rt(&mut c, &cmd(&[b"GET", b"big2"]), &bulk(&newer)).await;
    // Empty values are values.
    rt(&mut c, &cmd(&[b"SET", b"empty", b""]), b"+OK\r\n").await;
    rt(&mut c, &cmd(&[b"GET", b"empty"]), b"$0\r\n\r\n").await;
    s.stop().await;
}

#[tokio::test]
async fn a_value_larger_than_a_region_is_refused_with_a_reason() {
    let s = Server::start_with(RespOptions::default(), |c| TierConfig {
        disk_budget: 8 << 20,
        region_size: 1 << 20,
        ..c
    })
    .await;
    let mut c = s.connect().await;
    // Under `max_value` and the RAM budget, but no 1 MiB region holds it
    // with its headers: it could never be written.
    let val = vec![7u8; 1 << 20];
    c.write_all(&cmd(&[b"SET", b"k", &val]))
        .await
        .expect("write");
    let mut line = Vec::new();
    tokio::time::timeout(T, async {
        let mut b = [0u8; 1];
        while !line.ends_with(b"\r\n") {
            c.read_exact(&mut b).await.expect("read");
            line.push(b[0]);
        }
    })
    .await
    .expect("reply in time");
    let line = String::from_utf8(line).expect("utf-8");
    assert!(
        line.starts_with("-ERR kvtier could not store the value: ") && line.contains("region"),
        "{line}"
    );
    // Nothing was stored, and the connection goes on.
    rt(&mut c, &cmd(&[b"GET", b"k"]), b"$-1\r\n").await;
    rt(&mut c, &cmd(&[b"SET", b"k", &val[..1000]]), b"+OK\r\n").await;
    rt(&mut c, &cmd(&[b"GET", b"k"]), &bulk(&val[..1000])).await;
    s.stop().await;
}

#[tokio::test]
async fn pipelined_mix_of_inline_and_multibulk() {
    let s = Server::start(RespOptions::default()).await;
    let mut c = s.connect().await;
    let mut req = Vec::new();
    let mut want = Vec::new();
    for i in 0..200u32 {
        let k = format!("key{i}");
        let v = vec![(i % 251) as u8; (i as usize * 997) % 100_000];
        req.extend(cmd(&[b"SET", k.as_bytes(), &v]));
        want.extend_from_slice(b"+OK\r\n");
        req.extend(format!("EXISTS {k} missing{i}\r\n").as_bytes());
        want.extend_from_slice(b":1\r\n");
        req.extend(cmd(&[b"GET", k.as_bytes()]));
        want.extend(bulk(&v));
    }
    req.extend_from_slice(b"DBSIZE\r\n");
    want.extend_from_slice(b":200\r\n");
    let (mut r, mut w) = c.split();
    let writer = async {
        w.write_all(&req).await.expect("write");
    };
    let reader = async {
        let mut got = vec![0u8; want.len()];
        tokio::time::timeout(T, r.read_exact(&mut got))
            .await
            .expect("in time")
            .expect("read");
        got
    };
    let ((), got) = tokio::join!(writer, reader);
    assert!(got == want, "pipelined replies differ");
    drop(c);
    s.stop().await;
}

#[tokio::test]
async fn protocol_errors_reply_and_close() {
    let opts = RespOptions {
        max_value: 1 << 20,
        ..RespOptions::default()
    };
    let s = Server::start(opts).await;
    for (req, want) in [
        (&b"*1\r\n$x\r\n"[..], &b"-ERR Protocol error: invalid bulk length\r\n"[..]),
        (b"*x\r\n", b"-ERR Protocol error: invalid multibulk length\r\n"),
        (b"*1\r\n+a\r\n", b"-ERR Protocol error: expected '$', got '+'\r\n"),
        (b"*1\r\n$-5\r\n", b"-ERR Protocol error: invalid bulk length\r\n"),
        (b"set a \"b\r\n", b"-ERR Protocol error: unbalanced quotes in request\r\n"),
        (b"*2\r\n$3\r\nGET\r\n$1\r\nkXY\r\n", b"-ERR Protocol error: bulk string not terminated by CRLF\r\n"),
        // Announces 2 MiB and sends nothing more: refused before any allocation.
        (
            b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$2097152\r\n",
            b"-ERR Protocol error: invalid bulk length 2097152 (values are limited to 1048576 bytes)\r\n",
        ),
        (
            b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$99999999999999999999\r\n",
            b"-ERR Protocol error: invalid bulk length\r\n",
        ),
    ] {
        let mut c = s.connect().await;
        rt(&mut c, b"PING\r\n", b"+PONG\r\n").await;
        rt(&mut c, req, want).await;
        expect_eof(&mut c).await;
    }
    // Garbage without any line end: the inline limit closes it.
    let mut c = s.connect().await;
    let junk = vec![b'x'; 70 * 1024];
    let _ = c.write_all(&junk).await;
    expect(&mut c, b"-ERR Protocol error: too big inline request\r\n").await;
    expect_eof(&mut c).await;
    // Other clients and stored data are unaffected.
    let mut c = s.connect().await;
    rt(&mut c, b"SET k v\r\nGET k\r\n", b"+OK\r\n$1\r\nv\r\n").await;
    s.stop().await;
}

#[tokio::test]
async fn auth_flows() {
    let opts = RespOptions {
        password: Some("s3cret".into()),
        ..RespOptions::default()
    };
    let s = Server::start(opts).await;
    let mut c = s.connect().await;
    rt(&mut c, b"PING\r\n", b"-NOAUTH Authentication required.\r\n").await;
    rt(
        &mut c,
        b"GET k\r\n",
        b"-NOAUTH Authentication required.\r\n",
    )
    .await;
    rt(
        &mut c,
        b"FOO\r\n",
        b"-ERR unknown command 'FOO', with args beginning with: \r\n",
    )
    .await;
    rt(
        &mut c,
        b"GET\r\n",
        b"-ERR wrong number of arguments for 'get' command\r\n",
    )
    .await;
    rt(
        &mut c,
        b"HELLO 2\r\n",
        b"-NOAUTH HELLO must be called with the client already authenticated, otherwise the HELLO <proto> AUTH <user> <pass> option can be used to authenticate the client and select the RESP protocol version at the same time\r\n",
    )
    .await;
    rt(
        &mut c,
        b"AUTH nope\r\n",
        b"-WRONGPASS invalid username-password pair or user is disabled.\r\n",
    )
    .await;
    rt(
        &mut c,
        b"AUTH default nope\r\n",
        b"-WRONGPASS invalid username-password pair or user is disabled.\r\n",
    )
    .await;
    rt(
        &mut c,
        b"AUTH bob s3cret\r\n",
        b"-WRONGPASS invalid username-password pair or user is disabled.\r\n",
    )
    .await;
    rt(&mut c, b"AUTH s3cret\r\n", b"+OK\r\n").await;
    rt(&mut c, b"PING\r\n", b"+PONG\r\n").await;
    // Once authenticated, large values are accepted.
    let v = vec![1u8; 100_000];
    rt(&mut c, &cmd(&[b"SET", b"k", &v]), b"+OK\r\n").await;

    let mut c = s.connect().await;
    rt(
        &mut c,
        b"AUTH default s3cret\r\nGET k\r\n",
        &[&b"+OK\r\n"[..], &bulk(&v)].concat(),
    )
    .await;

    let mut c = s.connect().await;
    rt(&mut c, b"HELLO 2 AUTH default s3cret\r\n", b"*14\r\n").await;

    // Before AUTH, requests are limited as Redis limits them.
    let mut c = s.connect().await;
    rt(
        &mut c,
        &cmd(&[b"SET", b"k", &v]),
        b"-ERR Protocol error: invalid bulk length 100000 (values are limited to 16384 bytes)\r\n",
    )
    .await;
    expect_eof(&mut c).await;
    let mut c = s.connect().await;
    rt(
        &mut c,
        b"*11\r\n",
        b"-ERR Protocol error: invalid multibulk length\r\n",
    )
    .await;
    expect_eof(&mut c).await;
    s.stop().await;
}

#[tokio::test]
async fn lmcache_keys_get_one_namespace_per_rank() {
    let s = Server::start(RespOptions::default()).await;
    let mut c = s.connect().await;
    let v0 = vec![0xa0u8; 70_000];
    let v1 = vec![0xa1u8; 70_000];
    let k0: &[u8] = b"Qwen/Qwen3-8B@2@0@-448569d442b6a772@bfloat16";
    let k1: &[u8] = b"Qwen/Qwen3-8B@2@1@-448569d442b6a772@bfloat16";
    rt(&mut c, &cmd(&[b"EXISTS", k0]), b":0\r\n").await;
    rt(&mut c, &cmd(&[b"SET", k0, &v0]), b"+OK\r\n").await;
    rt(&mut c, &cmd(&[b"SET", k1, &v1]), b"+OK\r\n").await;
    rt(&mut c, &cmd(&[b"EXISTS", k0, k1]), b":2\r\n").await;
    rt(&mut c, &cmd(&[b"GET", k0]), &bulk(&v0)).await;
    rt(&mut c, &cmd(&[b"GET", k1]), &bulk(&v1)).await;
    rt(&mut c, &cmd(&[b"SET", b"plain", b"x"]), b"+OK\r\n").await;
    let mut ns: Vec<(String, u32, u32, String, u64)> = s
        .ctx
        .store
        .namespaces()
        .into_iter()
        .map(|n| {
            (
                n.record.engine,
                n.record.tp_size,
                n.record.rank,
                n.record.model,
                n.chunks,
            )
        })
        .collect();
    ns.sort();
    assert_eq!(
        ns,
        vec![
            ("lmcache-resp".into(), 2, 0, "Qwen/Qwen3-8B".into(), 1),
            ("lmcache-resp".into(), 2, 1, "Qwen/Qwen3-8B".into(), 1),
            ("resp".into(), 0, 0, String::new(), 1),
        ]
    );
    s.stop().await;
}

#[tokio::test]
async fn a_stored_name_is_compared_on_read() {
    // Through the public tier API: the same chunk id read under another name misses.
    let s = Server::start(RespOptions::default()).await;
    let mut c = s.connect().await;
    rt(&mut c, b"SET alpha one\r\n", b"+OK\r\n").await;
    let mapper = resp::keys::KeyMapper::new();
    let id = mapper.id(b"alpha");
    assert!(s.ctx.store.get_named(&id, b"alpha").is_some());
    assert!(s.ctx.store.get_named(&id, b"alphb").is_none());
    assert!(
        s.ctx
            .get(id, Some(Bytes::from_static(b"beta")))
            .await
            .is_none()
    );
    s.stop().await;
}

#[tokio::test]
async fn exists_pins_a_key_until_its_get() {
    // 1 MiB of RAM and no disk: a large SET evicts (drops) the small keys.
    let s = Server::start_with(RespOptions::default(), |c| TierConfig {
        ram_budget: 1 << 20,
        ..c
    })
    .await;
    let mut c = s.connect().await;
    rt(
        &mut c,
        b"SET p1 v1\r\nSET p2 v2\r\nSET p4 v4\r\nEXISTS p1 p2 p4\r\n",
        b"+OK\r\n+OK\r\n+OK\r\n:3\r\n",
    )
    .await;
    let mut c2 = s.connect().await;
    // Leaves less RAM than any small key takes (each is charged ~270 B).
    let big = vec![b'x'; (1 << 20) - 400];
    rt(&mut c2, &cmd(&[b"SET", b"big", &big]), b"+OK\r\n").await;
    let mapper = resp::keys::KeyMapper::new();
    for k in [&b"p1"[..], b"p2", b"p4"] {
        assert!(s.ctx.locate(&mapper.id(k)).is_none(), "evicted");
    }
    // p1: the pin serves the bytes checked by EXISTS, once.
    rt(&mut c, b"GET p1\r\nGET p1\r\n", b"$2\r\nv1\r\n$-1\r\n").await;
    // p2: a write through RESP since the EXISTS invalidates the pin.
    rt(&mut c, b"DEL p2\r\nGET p2\r\n", b":0\r\n$-1\r\n").await;
    // p4: so does a delete by another path (QA: `kvtier delete` of a key
    // pinned by EXISTS, and its GET served the deleted value).
    s.ctx.store.delete(&mapper.id(b"p4"));
    rt(&mut c, b"GET p4\r\n", b"$-1\r\n").await;
    // Another connection never sees this connection's pins.
    rt(&mut c2, b"SET p3 v3\r\n", b"+OK\r\n").await;
    rt(&mut c, b"EXISTS p3\r\n", b":1\r\n").await;
    assert!(s.ctx.store.delete(&mapper.id(b"p3")));
    rt(&mut c2, b"GET p3\r\n", b"$-1\r\n").await;
    s.stop().await;
}

/// INFO's `kvtier_pinned_bytes`, asked on `c`.
async fn pinned_bytes(c: &mut TcpStream) -> u64 {
    c.write_all(b"INFO memory\r\n").await.unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n") {
        let mut b = [0u8; 1];
        tokio::time::timeout(T, c.read_exact(&mut b))
            .await
            .unwrap()
            .unwrap();
        head.push(b[0]);
    }
    let len: usize = std::str::from_utf8(&head[1..head.len() - 2])
        .unwrap()
        .parse()
        .unwrap();
    let mut body = vec![0u8; len + 2];
    tokio::time::timeout(T, c.read_exact(&mut body))
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&body).into_owned();
    text.lines()
        .find_map(|l| l.strip_prefix("kvtier_pinned_bytes:"))
        .expect("kvtier_pinned_bytes in INFO memory")
        .trim()
        .parse()
        .unwrap()
}

/// QA: pins were dropped only when a GET looked at them, so an idle
/// connection kept an evicted value's bytes (past the RAM budget) until it
/// closed. They go when their time is up.
#[tokio::test]
async fn pins_go_when_their_time_is_up_on_idle_and_busy_connections() {
    let opts = RespOptions {
        pin_ttl: Duration::from_millis(300),
        ..RespOptions::default()
    };
    let s = Server::start(opts).await;
    let mut c = s.connect().await;
    let value = vec![b'v'; 1000];
    rt(&mut c, &cmd(&[b"SET", b"p1", &value]), b"+OK\r\n").await;
    rt(&mut c, b"EXISTS p1\r\n", b":1\r\n").await;
    let mut c2 = s.connect().await;
    assert_eq!(pinned_bytes(&mut c2).await, 1000);
    // c sends nothing more.
    let deadline = std::time::Instant::now() + T;
    loop {
        let held = pinned_bytes(&mut c2).await;
        if held == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the pin still holds {held} bytes"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A connection that keeps sending (its reads never wait: a pipeline
    // always in flight) drops them too (review).
    rt(&mut c, b"EXISTS p1\r\n", b":1\r\n").await;
    assert_eq!(pinned_bytes(&mut c2).await, 1000);
    let (mut rd, mut wr) = c.into_split();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (s1, s2) = (Arc::clone(&stop), Arc::clone(&stop));
    let pings = b"PING\r\n".repeat(2000);
    let writer = tokio::spawn(async move {
        while !s1.load(std::sync::atomic::Ordering::Relaxed) {
            if wr.write_all(&pings).await.is_err() {
                break;
            }
        }
    });
    let reader = tokio::spawn(async move {
        let mut buf = vec![0u8; 1 << 16];
        while !s2.load(std::sync::atomic::Ordering::Relaxed) {
            match tokio::time::timeout(Duration::from_millis(100), rd.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break,
                _ => {}
            }
        }
    });
    let deadline = std::time::Instant::now() + T;
    let mut held = pinned_bytes(&mut c2).await;
    while held != 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        held = pinned_bytes(&mut c2).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = writer.await;
    let _ = reader.await;
    assert_eq!(held, 0, "a busy connection's pin still holds {held} bytes");
    s.stop().await;
}

/// EXISTS is not a read: it counts no hit and no `bytes_out` (as Redis
/// counts no keyspace hit for it; QA saw each EXISTS of a 1 MiB value add
/// a hit and 1 MiB out); the GET that follows counts the read, also when
/// it is served from the pin.
#[tokio::test]
async fn exists_counts_no_read_and_its_get_counts_one() {
    let s = Server::start_with(RespOptions::default(), |c| TierConfig {
        ram_budget: 1 << 20,
        ..c
    })
    .await;
    let mut c = s.connect().await;
    rt(
        &mut c,
        b"SET p1 value1\r\nSET p2 value2\r\n",
        b"+OK\r\n+OK\r\n",
    )
    .await;
    let before = s.ctx.store.stats();
    rt(&mut c, b"EXISTS p1 p2 nokey\r\n", b":2\r\n").await;
    let after = s.ctx.store.stats();
    assert_eq!(
        (after.hits_ram, after.bytes_out, after.misses),
        (before.hits_ram, before.bytes_out, before.misses)
    );
    rt(&mut c, b"GET p1\r\n", b"$6\r\nvalue1\r\n").await;
    // p2 is evicted behind the client's back (RAM only: dropped): its GET
    // is served from the pin.
    let mapper = resp::keys::KeyMapper::new();
    let mut c2 = s.connect().await;
    rt(
        &mut c2,
        &cmd(&[b"SET", b"big", &vec![b'x'; (1 << 20) - 400]]),
        b"+OK\r\n",
    )
    .await;
    assert!(s.ctx.locate(&mapper.id(b"p2")).is_none(), "evicted");
    let before_get = s.ctx.store.stats();
    rt(&mut c, b"GET p2\r\n", b"$6\r\nvalue2\r\n").await;
    let end = s.ctx.store.stats();
    assert_eq!(end.hits_ram, before.hits_ram + 2);
    assert_eq!(end.bytes_out, before_get.bytes_out + 6);
    // and counts no miss (the store was asked first: a miss and a hit).
    assert_eq!(end.misses, before.misses);
    // A key too long to store is absent: its GET is a miss (it counted
    // nothing, so hits + misses fell short of the GETs).
    let long = vec![b'k'; resp::keys::MAX_KEY_LEN + 1];
    c.write_all(&cmd(&[b"GET", &long])).await.unwrap();
    expect(&mut c, b"$-1\r\n").await;
    assert_eq!(s.ctx.store.stats().misses, end.misses + 1);
    s.stop().await;
}

#[tokio::test]
async fn connection_limit_and_shutdown() {
    let opts = RespOptions {
        max_connections: 1,
        ..RespOptions::default()
    };
    let s = Server::start(opts).await;
    let mut c1 = s.connect().await;
    rt(&mut c1, b"PING\r\n", b"+PONG\r\n").await;
    let mut c2 = s.connect().await;
    expect(&mut c2, b"-ERR max number of clients reached\r\n").await;
    expect_eof(&mut c2).await;
    // The open connection does not keep the server from stopping.
    s.stop().await;
    expect_eof(&mut c1).await;
}

#[tokio::test]
async fn check_bind_refuses_public_addresses_without_password() {
    let any: SocketAddr = "0.0.0.0:6380".parse().expect("addr");
    let err = resp::check_bind(&any, None).expect_err("refused");
    assert!(err.to_string().contains("without a password"), "{err}");
    assert!(resp::check_bind(&any, Some("pw")).is_ok());
    assert!(resp::check_bind(&"127.0.0.1:6380".parse().expect("addr"), None).is_ok());
}

#[tokio::test]
async fn a_pipeline_written_before_any_reply_is_read_is_served() {
    let s = Server::start(RespOptions::default()).await;
    let mut c = s.connect().await;
    let v = vec![5u8; 1 << 20];
    rt(&mut c, &cmd(&[b"SET", b"big", &v]), b"+OK\r\n").await;
    // 64 MiB of replies are due before the client reads anything, and a 2 MiB
    // SET follows the GETs: the server must keep reading while it cannot write.
    let mut req = Vec::new();
    for _ in 0..64 {
        req.extend(cmd(&[b"GET", b"big"]));
    }
    let v2 = vec![6u8; 2 << 20];
    req.extend(cmd(&[b"SET", b"big2", &v2]));
    req.extend_from_slice(b"PING\r\n");
    tokio::time::timeout(T, c.write_all(&req))
        .await
        .expect("the whole pipeline is accepted before any reply is read")
        .expect("write");
    let one = bulk(&v);
    for _ in 0..64 {
        expect(&mut c, &one).await;
    }
    expect(&mut c, b"+OK\r\n+PONG\r\n").await;
    rt(&mut c, &cmd(&[b"GET", b"big2"]), &bulk(&v2)).await;
    s.stop().await;
}

/// A pipeline that arrives in small pieces while the replies back up: the
/// commands read ahead during the blocked reply write are served without
/// waiting for more input (they sat in the buffer until the client sent
/// another byte, which it never did: the connection hung).
#[tokio::test]
async fn commands_read_ahead_while_replies_wait_are_served_without_more_input() {
    let s = Server::start(RespOptions::default()).await;
    let mut c = s.connect().await;
    let v = vec![7u8; 5000];
    rt(&mut c, &cmd(&[b"SET", b"v", &v]), b"+OK\r\n").await;
    let mut req = Vec::new();
    for _ in 0..2000 {
        req.extend(cmd(&[b"GET", b"v"]));
    }
    req.extend_from_slice(b"PING\r\n");
    c.set_nodelay(true).expect("nodelay");
    let (mut rd, mut wr) = c.into_split();
    // Sent a byte at a time, nothing read meanwhile.
    for piece in req.chunks(1) {
        tokio::time::timeout(T, wr.write_all(piece))
            .await
            .expect("the pipeline is accepted")
            .expect("write");
    }
    let mut want = Vec::new();
    for _ in 0..2000 {
        want.extend(bulk(&v));
    }
    want.extend_from_slice(b"+PONG\r\n");
    let mut got = vec![0u8; want.len()];
    tokio::time::timeout(T, rd.read_exact(&mut got))
        .await
        .expect("every reply arrives without more input")
        .expect("read");
    assert!(got == want, "replies differ");
    drop(wr);
    s.stop().await;
}

/// Large values being received are bounded over all connections: a client
/// that announces a value and sends only part of it holds its share; past
/// the bound the next one gets an error and is closed, others keep
/// working, and the share comes back when the first goes.
#[tokio::test]
async fn large_values_being_received_are_bounded_over_all_connections() {
    let s = Server::start(RespOptions {
        max_receiving: 1 << 20,
        ..RespOptions::default()
    })
    .await;
    let head = |len: usize| format!("*3\r\n$3\r\nSET\r\n$1\r\nk\r\n${len}\r\n").into_bytes();
    // Holds 800 KiB: announced, 1 KiB sent.
    let mut a = s.connect().await;
    a.write_all(&head(800 << 10)).await.expect("write");
    a.write_all(&[1u8; 1024]).await.expect("write");
    let mut w = s.connect().await;
    rt(&mut w, b"PING\r\n", b"+PONG\r\n").await;
    // 400 KiB more would pass 1 MiB: refused, closed (once a's task has
    // taken its share; a probe that is not answered is dropped, which
    // gives its own share back).
    let mut said = String::new();
    for _ in 0..50 {
        let mut b = s.connect().await;
        b.write_all(&head(400 << 10)).await.expect("write");
        let answer = tokio::time::timeout(Duration::from_millis(200), b.read_to_string(&mut said));
        if answer.await.is_ok() {
            break;
        }
    }
    assert!(
        said.starts_with("-ERR") && said.contains("at most 1 MiB"),
        "{said}"
    );
    rt(&mut w, b"PING\r\n", b"+PONG\r\n").await;
    drop(a);
    // Its share is back once its task ends: the same value is taken.
    let v = vec![2u8; 400 << 10];
    let mut ok = false;
    for _ in 0..100 {
        let mut c = s.connect().await;
        c.write_all(&cmd(&[b"SET", b"k2", &v]))
            .await
            .expect("write");
        let mut got = [0u8; 5];
        if tokio::time::timeout(T, c.read_exact(&mut got))
            .await
            .is_ok_and(|r| r.is_ok())
            && &got == b"+OK\r\n"
        {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ok, "the share came back");
    rt(&mut w, &cmd(&[b"GET", b"k2"]), &bulk(&v)).await;
    s.stop().await;
}

/// A client that stops sending in the middle of a large value is closed
/// once `value_timeout` has passed, and its share of the receive bound
/// comes back (QA: two idle clients announcing 512 MiB each refused every
/// other large SET for as long as they stayed connected).
#[tokio::test]
async fn a_client_stalled_in_a_large_value_is_closed_and_its_share_freed() {
    let s = Server::start(RespOptions {
        max_receiving: 1 << 20,
        value_timeout: Duration::from_millis(300),
        ..RespOptions::default()
    })
    .await;
    let mut a = s.connect().await;
    a.write_all(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$900000\r\n")
        .await
        .expect("write");
    a.write_all(&[1u8; 1024]).await.expect("write");
    let mut said = String::new();
    tokio::time::timeout(T, a.read_to_string(&mut said))
        .await
        .expect("closed within the value timeout")
        .expect("read");
    assert!(
        said.starts_with("-ERR a value of 900000 bytes stalled (nothing for 0.3 s"),
        "{said}"
    );
    // Its share is back: a value that would not fit beside it is taken.
    let v = vec![2u8; 800 << 10];
    let mut c = s.connect().await;
    rt(&mut c, &cmd(&[b"SET", b"k2", &v]), b"+OK\r\n").await;
    rt(&mut c, &cmd(&[b"GET", b"k2"]), &bulk(&v)).await;
    // A value that takes longer than the timeout but keeps coming, at more
    // than 1 MiB/s, is taken (the timeout is for a stall, not the whole).
    let v = vec![3u8; 900 << 10];
    let req = cmd(&[b"SET", b"k3", &v]);
    let t0 = std::time::Instant::now();
    for piece in req.chunks(req.len() / 8 + 1) {
        c.write_all(piece).await.expect("write");
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    assert!(t0.elapsed() > Duration::from_millis(300));
    let mut got = [0u8; 5];
    tokio::time::timeout(T, c.read_exact(&mut got))
        .await
        .expect("answered")
        .expect("read");
    assert_eq!(&got, b"+OK\r\n");
    // One that trickles a few bytes at a time, never stalling for the
    // timeout, is closed all the same once it falls below that rate.
    let mut d = s.connect().await;
    d.write_all(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$900000\r\n")
        .await
        .expect("write");
    let t0 = std::time::Instant::now();
    let mut said = Vec::new();
    let mut buf = [0u8; 256];
    while t0.elapsed() < T {
        // Closed: the write fails or the read ends.
        if d.write_all(&[4u8; 16]).await.is_err() {
            break;
        }
        match tokio::time::timeout(Duration::from_millis(100), d.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => break,
            Ok(Ok(n)) => said.extend_from_slice(&buf[..n]),
            Err(_) => {}
        }
    }
    let said = String::from_utf8_lossy(&said);
    assert!(t0.elapsed() < T, "a trickle was never closed");
    assert!(said.is_empty() || said.contains("stalled"), "{said}");
    rt(&mut c, &cmd(&[b"GET", b"k3"]), &bulk(&v)).await;
    s.stop().await;
}
