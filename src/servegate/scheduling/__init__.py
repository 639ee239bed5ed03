"""The endpoint picker: filters, scorers, pickers and profile handlers (llm-d's EPP contract)."""
