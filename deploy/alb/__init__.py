"""The EC2 + ALB deployment: its template and the stepwise release that acts on the canary."""
