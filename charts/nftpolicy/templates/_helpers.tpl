{{/* The chart's name, at most 63 characters. */}}
{{- define "nftpolicy.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The full name of the release's objects: the release name, plus the chart's name unless the
release name already contains it. */}}
{{- define "nftpolicy.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Chart name and version, for the helm.sh/chart label. */}}
{{- define "nftpolicy.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select the agent's pods; they never change across upgrades. */}}
{{- define "nftpolicy.selectorLabels" -}}
app.kubernetes.io/name: {{ include "nftpolicy.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The standard labels of every object. */}}
{{- define "nftpolicy.labels" -}}
helm.sh/chart: {{ include "nftpolicy.chart" . }}
{{ include "nftpolicy.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: agent
app.kubernetes.io/part-of: nftpolicy
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "nftpolicy.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "nftpolicy.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "nftpolicy.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (toString (default .Chart.AppVersion .Values.image.tag)) }}
{{- end }}
{{- end }}

{{/* The port of agent.httpAddress (HOST:PORT, HOST may be [IPv6]). */}}
{{- define "nftpolicy.httpPort" -}}
{{- regexFind "[0-9]+$" .Values.agent.httpAddress | int }}
{{- end }}

{{/* The host of agent.httpAddress, without IPv6 brackets. */}}
{{- define "nftpolicy.httpHost" -}}
{{- regexReplaceAll ":[0-9]+$" .Values.agent.httpAddress "" | trimPrefix "[" | trimSuffix "]" }}
{{- end }}

{{/* The probes' host: none (the pod's, that is the node's, address) when the agent listens on
every address, else the one address it listens on. */}}
{{- define "nftpolicy.probeHost" -}}
{{- $host := include "nftpolicy.httpHost" . }}
{{- if not (has $host (list "" "0.0.0.0" "::")) }}
{{- $host }}
{{- end }}
{{- end }}

{{/* One probe: the fixed path and port, the timings from values. */}}
{{- define "nftpolicy.probe" -}}
{{- $root := index . 0 -}}
httpGet:
  path: {{ index . 1 }}
  port: http
  {{- if $root.Values.agent.metricsSecure }}
  scheme: HTTPS
  {{- end }}
  {{- with include "nftpolicy.probeHost" $root }}
  host: {{ . | quote }}
  {{- end }}
{{ toYaml (index . 2) }}
{{- end }}

{{/* The certificate the agent serves with agent.metricsSecure: agent.tlsCertFile, else the
mounted tls.secretName's, else none (self-signed). */}}
{{- define "nftpolicy.tlsCertFile" -}}
{{- if .Values.agent.tlsCertFile }}{{ .Values.agent.tlsCertFile }}{{ else if .Values.tls.secretName }}/etc/nftpolicy/tls/tls.crt{{ end }}
{{- end }}

{{- define "nftpolicy.tlsPrivateKeyFile" -}}
{{- if .Values.agent.tlsPrivateKeyFile }}{{ .Values.agent.tlsPrivateKeyFile }}{{ else if .Values.tls.secretName }}/etc/nftpolicy/tls/tls.key{{ end }}
{{- end }}

{{/* The metrics Service's port name: https-metrics with agent.metricsSecure, else http-metrics. */}}
{{- define "nftpolicy.metricsPortName" -}}
{{- if .Values.agent.metricsSecure }}https-metrics{{ else }}http-metrics{{ end }}
{{- end }}

{{/* A mark as the agent reads it: a string as it is (0x...), a YAML number in decimal (never in
the exponent notation that Helm prints for large numbers). */}}
{{- define "nftpolicy.mark" -}}
{{- if kindIs "string" . }}{{ . }}{{ else }}{{ . | int64 | toString }}{{ end }}
{{- end }}
