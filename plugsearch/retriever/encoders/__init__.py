"""The dense encoder: queries and passages into vectors (sentence-transformers, or its ONNX export), and the
identity of what it encodes."""
