"""The demo model, built once from offline text: corpus, tokenizer, pretraining, adapters, publishing (`mol2 build`,
or `python -m engine_build`). The engines' export (ONNX, TensorRT) is the engine's: ced/onnx_export.py."""
