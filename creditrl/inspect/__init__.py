"""Views that show every token's quantities (explain tables; more to come)."""
