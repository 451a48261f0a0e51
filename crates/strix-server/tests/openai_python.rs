//! The official `openai` Python client against the server (`tests/python/openai_client.py`):
//! chat whole and streamed, completions, stop strings, seeds, logprobs, the reasoning split,
//! tools, structured output (`response_format`, `beta.chat.completions.parse` with a pydantic
//! model, forced tool calls, `logit_bias`), errors and auth. Runs when `STRIX_OPENAI_PYTHON` names a Python that can
//! `import openai` (`.ci/run` prepares one in a virtualenv); without it, it says it skipped.

mod common;

use std::path::Path;
use std::process::Command;

#[test]
fn the_openai_python_client_works_against_the_server() {
    let Some(python) = std::env::var_os("STRIX_OPENAI_PYTHON") else {
        println!("skipped: STRIX_OPENAI_PYTHON is not set (.ci/run sets it to a virtualenv with openai)");
        return;
    };
    // Set but broken is a failure, not a skip: CI sets it only after installing the client.
    let import = Command::new(&python).args(["-c", "import openai, jsonschema"]).output();
    assert!(
        import.is_ok_and(|o| o.status.success()),
        "STRIX_OPENAI_PYTHON={} cannot import openai and jsonschema",
        python.to_string_lossy()
    );
    // The template's tool instructions (forced tool calls) are long in the fixture's vocabulary.
    let server = common::start(|c| {
        c.api_key = Some("test-key".into());
        c.engine.context = 4096;
    });
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/openai_client.py");
    let out = Command::new(&python)
        .arg(&script)
        .arg(format!("http://{}/v1", server.addr()))
        .arg("test-key")
        .arg("tiny")
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the openai client checks failed:\n{stdout}\n{stderr}");
    println!("{}", stdout.trim());
}
