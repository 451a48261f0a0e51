#!/bin/sh
# Seeds each fuzz target's corpus (fuzz/corpus/<target>/, not committed) with the
# repository's fixtures: valid files are where mutation finds the deep paths.
set -eu
cd "$(dirname "$0")"
mkdir -p corpus/gguf corpus/safetensors corpus/config
cp ../tests/fixtures/gguf-models/*.gguf ../tests/fixtures/gguf/*.gguf corpus/gguf/
for dir in ../tests/fixtures/models/*/; do
    name=$(basename "$dir")
    for f in "$dir"*.safetensors; do
        case "$f" in
            *goldens*) ;;
            *) cp "$f" "corpus/safetensors/$name-$(basename "$f")" ;;
        esac
    done
    cp "$dir/config.json" "corpus/config/$name.json"
done
echo "seeded: $(ls corpus/gguf | wc -l) gguf, $(ls corpus/safetensors | wc -l) safetensors, $(ls corpus/config | wc -l) config"
