{{/* Names and labels shared by the templates. */}}
{{- define "gpudra.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpudra.fullname" -}}
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

{{- define "gpudra.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "gpudra.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "gpudra.pluginSelector" -}}
app.kubernetes.io/name: {{ include "gpudra.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: kubelet-plugin
{{- end -}}

{{- define "gpudra.pluginServiceAccount" -}}
{{- default (printf "%s-kubelet-plugin" (include "gpudra.fullname" .)) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "gpudra.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "gpudra.controllerSelector" -}}
app.kubernetes.io/name: {{ include "gpudra.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: controller
{{- end -}}

{{/* The controller's names: its ServiceAccount and RBAC, Lease, webhook Service, configuration and certificate Secret. */}}
{{- define "gpudra.controllerName" -}}
{{- printf "%s-controller" (include "gpudra.fullname" .) -}}
{{- end -}}

{{- define "gpudra.webhookName" -}}
{{- printf "%s-webhook" (include "gpudra.fullname" .) -}}
{{- end -}}

{{- define "gpudra.webhookSecret" -}}
{{- printf "%s-webhook-cert" (include "gpudra.fullname" .) -}}
{{- end -}}

{{/* MPS server pods run as this ServiceAccount: no permissions, no token. */}}
{{- define "gpudra.mpsServerServiceAccount" -}}
{{- printf "%s-mps-server" (include "gpudra.fullname" .) -}}
{{- end -}}
