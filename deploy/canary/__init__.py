"""`inf2serve canary`: replay a prompt set against a baseline and a candidate endpoint, compare their
answers and their `/metrics`, and say whether the candidate may take more traffic."""
