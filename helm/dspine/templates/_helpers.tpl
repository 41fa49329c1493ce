{{/* Names and labels shared by every template. */}}
{{- define "dspine.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dspine.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "dspine.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dspine.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dspine.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "dspine.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "dspine.image" -}}
{{ .Values.image.repository }}:{{ default .Chart.AppVersion .Values.image.tag }}
{{- end -}}

{{/* The application's args: the cluster values, plus the env var of the bearer token when auth is on. */}}
{{- define "dspine.args" -}}
{{- $args := deepCopy .Values.cluster -}}
{{- if .Values.auth.secretName -}}
{{- $_ := set $args.ingress "auth_token_env" "DSPINE_AUTH_TOKEN" -}}
{{- end -}}
{{- toYaml $args -}}
{{- end -}}

{{/* serveConfigV2: the same document as cluster/serve_config.yaml, built from .Values.cluster. */}}
{{- define "dspine.serveConfig" -}}
{{- $c := .Values.cluster -}}
proxy_location: EveryNode
http_options:
  host: 0.0.0.0
  port: {{ $c.http_port }}
grpc_options:
  port: {{ $c.grpc_port }}
  grpc_servicer_functions:
    - dspine.cluster.servicer.add_to_server
  request_timeout_s: {{ $c.request_timeout_s }}
applications:
  - name: {{ $c.app_name }}
    route_prefix: /{{ $c.app_name }}
    import_path: dspine.cluster.app:build_app
    args:
{{ include "dspine.args" . | indent 6 }}
{{- end -}}

{{/* Environment of every Ray container: message limit, tracing, the bearer token. */}}
{{- define "dspine.env" -}}
- name: RAY_SERVE_GRPC_MAX_MESSAGE_SIZE
  value: {{ .Values.cluster.max_message_bytes | int64 | quote }}
{{- if .Values.tracing.enabled }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .Values.tracing.otlpEndpoint | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ .Values.tracing.serviceName | quote }}
- name: RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH
  value: dspine.cluster.tracing:span_processors
- name: RAY_SERVE_TRACING_SAMPLING_RATIO
  value: {{ .Values.tracing.samplingRatio | quote }}
{{- end }}
{{- if .Values.auth.secretName }}
- name: DSPINE_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.auth.secretName }}
      key: {{ .Values.auth.secretKey }}
{{- end }}
{{- end -}}

{{- define "dspine.ports" -}}
- {containerPort: 6379, name: gcs}
- {containerPort: 8265, name: dashboard}
- {containerPort: 10001, name: client}
- {containerPort: 8080, name: metrics}
- {containerPort: {{ .Values.cluster.http_port }}, name: serve}
- {containerPort: {{ .Values.cluster.grpc_port }}, name: serve-grpc}
{{- end -}}

{{- define "dspine.probes" -}}
readinessProbe:
  httpGet: {path: /-/healthz, port: {{ .Values.cluster.http_port }}}
  periodSeconds: 5
  failureThreshold: 12
livenessProbe:
  httpGet: {path: /-/healthz, port: {{ .Values.cluster.http_port }}}
  initialDelaySeconds: 120
  periodSeconds: 10
  failureThreshold: 6
{{- end -}}
