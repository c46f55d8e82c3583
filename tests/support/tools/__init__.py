"""Tools the suites drive: the real helm (fetched and run), Mermaid's parser for the docs, and the operator's own option parsing."""
