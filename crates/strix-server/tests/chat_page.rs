//! The built-in chat page (`GET /`) in headless Chromium, driven over WebDriver by
//! chromedriver (Debian's `chromium` and `chromium-driver`): it types a message, sends it,
//! and reads the streamed answer and reasoning back from the page, which must match what
//! the API returns for the same request. Also checks the page's markdown renderer escapes
//! HTML. Runs when `STRIX_CHROMEDRIVER` names a chromedriver (`.ci/run` sets it when the
//! packages are installed); without it, it says it skipped.

mod common;

use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};

use common::*;
use serde_json::{json, Value};

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

struct Driver {
    addr: SocketAddr,
    child: Child,
    session: String,
    _profile: tempdir::TempDir,
}

/// A throwaway directory for the browser profile, removed on drop (no tempfile dependency).
mod tempdir {
    pub struct TempDir(pub std::path::PathBuf);
    impl TempDir {
        pub fn new() -> Self {
            let dir = std::env::temp_dir().join(format!("strix-chromium-{}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("profile dir");
            TempDir(dir)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl Driver {
    fn start(chromedriver: &str) -> Driver {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        wait_until("chromedriver listens", || std::net::TcpStream::connect(addr).is_ok());
        let profile = tempdir::TempDir::new();
        let binary = std::env::var("STRIX_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
        // The flags keep Chromium off the network (this machine has none) and out of a sandbox
        // that root cannot use.
        let capabilities = json!({"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {
            "binary": binary,
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--disable-quic", "--no-first-run", "--disable-background-networking",
                     "--disable-component-update", "--disable-sync",
                     format!("--user-data-dir={}", profile.0.display())],
        }}}});
        let mut driver = Driver { addr, child, session: String::new(), _profile: profile };
        let created = driver.call("POST", "/session", &capabilities);
        driver.session =
            created["sessionId"].as_str().unwrap_or_else(|| panic!("no session: {created}")).to_owned();
        driver
    }

    /// A WebDriver command; returns its `value`.
    fn call(&self, method: &str, path: &str, body: &Value) -> Value {
        let body = if method == "POST" { body.to_string() } else { String::new() };
        let r = request(self.addr, method, path, &[], body.as_bytes());
        let value = r.json()["value"].clone();
        assert_eq!(r.status, 200, "WebDriver {method} {path}: {value}");
        value
    }

    fn session_call(&self, path: &str, body: Value) -> Value {
        self.call("POST", &format!("/session/{}{path}", self.session), &body)
    }

    fn script(&self, script: &str) -> Value {
        self.session_call("/execute/sync", json!({"script": script, "args": []}))
    }

    fn element(&self, css: &str) -> String {
        let found = self.session_call("/element", json!({"using": "css selector", "value": css}));
        found[ELEMENT].as_str().unwrap_or_else(|| panic!("no element {css}: {found}")).to_owned()
    }

    fn type_into(&self, css: &str, text: &str) {
        let element = self.element(css);
        self.session_call(&format!("/element/{element}/value"), json!({"text": text}));
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = request(self.addr, "DELETE", &format!("/session/{}", self.session), &[], b"");
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends `message` from the page and waits for the answer: (answer text, reasoning, meta).
fn chat_in_page(driver: &Driver, message: &str) -> (String, String, String) {
    let before = driver.script("return document.querySelectorAll('.assistant').length").as_u64().unwrap();
    driver.type_into("#input", message);
    let send = driver.element("#send");
    driver.session_call(&format!("/element/{send}/click"), json!({}));
    let mut result = Value::Null;
    wait_until("the page shows the whole answer", || {
        result = driver.script(&format!(
            "const boxes = document.querySelectorAll('.assistant'); const b = boxes[{before}];
             if (!b || !b.dataset.done) return null;
             if (b.querySelector('.error')) return ['ERROR', b.querySelector('.error').textContent, ''];
             return [b.querySelector('.answer').textContent, b.querySelector('.thoughts').textContent,
                     b.querySelector('.meta').textContent];"
        ));
        !result.is_null()
    });
    let field = |i: usize| result[i].as_str().unwrap_or_default().to_owned();
    assert_ne!(field(0), "ERROR", "the page showed an error: {}", field(1));
    (field(0), field(1), field(2))
}

#[test]
fn the_chat_page_streams_an_answer_in_chromium() {
    let Ok(chromedriver) = std::env::var("STRIX_CHROMEDRIVER") else {
        println!(
            "skipped: STRIX_CHROMEDRIVER is not set (.ci/run sets it when chromium-driver is installed)"
        );
        return;
    };
    let server = start(|c| c.api_key = Some("page-key".into()));
    let addr = server.addr();
    let driver = Driver::start(&chromedriver);
    driver.session_call("/url", json!({"url": format!("http://{addr}/")}));
    assert_eq!(driver.script("return document.title"), "strix chat");

    // Settings, through the page's own inputs: greedy, short, the key.
    driver.script(
        "document.getElementById('temperature').value = '0';
         document.getElementById('max-tokens').value = '24';
         const key = document.getElementById('key'); key.value = 'page-key';
         key.dispatchEvent(new Event('change'));",
    );
    wait_until("the page lists the model", || {
        driver.script("return document.getElementById('model').textContent") == "tiny"
    });

    let expected = |thinking: bool, history: Value| {
        let r = request(
            addr,
            "POST",
            CHAT_PATH,
            &[("Authorization", "Bearer page-key")],
            json!({"messages": history, "temperature": 0, "max_tokens": 24,
                   "chat_template_kwargs": {"enable_thinking": thinking}})
            .to_string()
            .as_bytes(),
        );
        r.json()["choices"][0]["message"].clone()
    };

    // Thinking on: the page shows the reasoning apart, exactly as the API returns it.
    let (answer, reasoning, meta) = chat_in_page(&driver, "Hello there");
    let api = expected(true, json!([{"role": "user", "content": "Hello there"}]));
    assert_eq!(reasoning, api["reasoning_content"].as_str().unwrap_or(""));
    assert_eq!(answer.is_empty(), api["content"].as_str().unwrap_or("").is_empty());
    assert!(meta.contains("finish: "), "{meta}");

    // Thinking off, second turn: the answer is content.
    driver.script("document.getElementById('think').checked = false");
    let (answer, reasoning, _) = chat_in_page(&driver, "And again");
    assert!(reasoning.is_empty());
    let history = driver.script("return conversation");
    let api = expected(false, history.as_array().unwrap()[..3].to_vec().into());
    assert_eq!(answer.is_empty(), api["content"].as_str().unwrap_or("").is_empty());

    // The markdown renderer formats and never lets HTML through.
    let html = driver.script("return markdown('**bold** `x<y` <script>alert(1)</script>\\n\\n```rust\\nfn main() {}\\n```\\n- a\\n- b')");
    let html = html.as_str().unwrap();
    for part in [
        "<strong>bold</strong>",
        "<code>x&lt;y</code>",
        "&lt;script&gt;",
        "<pre><code class=\"language-rust\">fn main() {}",
        "<ul><li>a</li><li>b</li></ul>",
    ] {
        assert!(html.contains(part), "{part} not in {html}");
    }
    assert!(!html.contains("<script>"));
}
