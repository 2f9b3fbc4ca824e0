"""SageMaker real-time endpoint: `template.yaml` (CloudFormation) and the `inf2serve deploy sagemaker`
helper that releases a new artifact through the same guardrails with boto3."""
