//! Fetching a model from the Hugging Face Hub (through the `hf-hub` crate and its cache), so
//! `strix run` works with no `--model`: the files a model directory needs, with progress bars.

use std::path::PathBuf;

use crate::error::{Error, Result};

/// The model `strix run` uses when no `--model` is given.
pub const DEFAULT_MODEL: &str = "Qwen/Qwen3.5-0.8B";

/// Files fetched when present in the repository; missing ones are fine.
const OPTIONAL_FILES: &[&str] =
    &["generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"];

/// Downloads (or finds in the local Hugging Face cache) the config, tokenizer and safetensors
/// weights of `repo_id` and returns the directory that holds them.
pub fn fetch_model(repo_id: &str) -> Result<PathBuf> {
    let offline = |e: &dyn std::fmt::Display| {
        Error::Download(format!(
            "could not fetch {repo_id} from the Hugging Face Hub ({e}). Check the network connection \
             (and HF_ENDPOINT / HF_TOKEN if you use them), or pass --model DIR with a local checkpoint"
        ))
    };
    let api =
        hf_hub::api::sync::ApiBuilder::from_env().with_progress(true).build().map_err(|e| offline(&e))?;
    let repo = api.model(repo_id.to_string());
    let config = repo.get("config.json").map_err(|e| offline(&e))?;
    let dir = config.parent().map(PathBuf::from).ok_or_else(|| offline(&"cache path has no parent"))?;
    for name in OPTIONAL_FILES {
        // A repository without a chat template or generation config is still usable.
        let _ = repo.get(name);
    }
    match repo.get("model.safetensors.index.json") {
        Ok(index) => {
            let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
            let value: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::checkpoint(&index, format!("invalid JSON: {e}")))?;
            let mut shards: Vec<String> = value
                .get("weight_map")
                .and_then(|m| m.as_object())
                .map(|m| m.values().filter_map(|v| v.as_str().map(String::from)).collect())
                .unwrap_or_default();
            shards.sort();
            shards.dedup();
            for shard in shards {
                repo.get(&shard).map_err(|e| offline(&e))?;
            }
        }
        Err(_) => {
            repo.get("model.safetensors").map_err(|e| offline(&e))?;
        }
    }
    Ok(dir)
}
