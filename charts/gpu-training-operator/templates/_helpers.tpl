{{/* Names, labels and the checks that values.schema.json cannot express. */}}

{{- define "gpuop.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpuop.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "gpuop.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "gpuop.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gpuop.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpuop.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "gpuop.labels" -}}
{{ include "gpuop.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: gpu-training-operator
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "gpuop.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "gpuop.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name: set it to an existing ServiceAccount when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- /* The operator pods' PriorityClass: the one named, else the chart's own (priorityclass.yaml). */ -}}
{{- define "gpuop.priorityClassName" -}}
{{- if .Values.priorityClassName -}}
{{- .Values.priorityClassName -}}
{{- else if dig "create" true (.Values.priorityClass | default dict) -}}
{{- include "gpuop.fullname" . -}}
{{- end -}}
{{- end -}}

{{- define "gpuop.image" -}}
{{- $repository := .Values.image.repository | default (printf "%s/operator" .Values.registry) -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" $repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The trainer image of GpuTrainings without spec.image: this release's, unless set. */}}
{{- define "gpuop.trainerImage" -}}
{{- .Values.operator.trainerImage | default (printf "%s/trainer:%s" .Values.registry .Chart.AppVersion) -}}
{{- end -}}

{{/* The label every trainer pod carries (gpuop.api.identity.TRAINING_LABEL). */}}
{{- define "gpuop.trainingLabel" -}}gpuop.io/gputraining{{- end -}}

{{/* Namespaces that get a NetworkPolicy for trainer pods. */}}
{{- define "gpuop.networkPolicyNamespaces" -}}
{{- $namespaces := .Values.networkPolicy.namespaces | default .Values.watchNamespaces -}}
{{- if not $namespaces -}}
{{- fail "networkPolicy.namespaces: a NetworkPolicy lives in one namespace; list the trainer namespaces there (or set watchNamespaces)" -}}
{{- end -}}
{{- toJson $namespaces -}}
{{- end -}}

{{/* Value combinations the schema cannot refuse, each one line naming the fix. */}}
{{- define "gpuop.checks" -}}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.leaderElection.enabled) -}}
{{- fail "replicaCount > 1 needs leaderElection.enabled=true: without it every replica would reconcile every GpuTraining" -}}
{{- end -}}
{{- if ge (float64 .Values.operator.scrapeTimeout) (float64 .Values.operator.scrapeInterval) -}}
{{- fail "operator.scrapeTimeout must be shorter than operator.scrapeInterval" -}}
{{- end -}}
{{- if eq (int .Values.metrics.port) (int .Values.health.port) -}}
{{- fail "metrics.port and health.port must differ" -}}
{{- end -}}
{{- range .Values.extraEnv -}}
{{- if or (hasPrefix "GPUOP_" .name) (eq .name "POD_ID") -}}
{{- fail (printf "extraEnv: %s is set by the chart from its values (see values.yaml under operator, metrics, health and leaderElection); set the value instead" .name) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The progress-report endpoint: its Service, the URL trainers are given, its TLS Secret.
*/}}
{{- define "gpuop.reportService" -}}
{{ include "gpuop.fullname" . }}-reports
{{- end }}

{{- define "gpuop.reportURL" -}}
https://{{ include "gpuop.reportService" . }}.{{ .Release.Namespace }}.svc:{{ .Values.reports.service.port }}
{{- end }}

{{- define "gpuop.reportSecret" -}}
{{ .Values.reports.tls.secretName | default (printf "%s-report-tls" (include "gpuop.fullname" .)) }}
{{- end }}
